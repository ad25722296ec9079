//! Which broker session a session handle is on. Each broker session it has had is a
//! [`Generation`] (its `opened` record and a number); [`Generations`] holds the current
//! one, whether it is connected, and the ids of the leases held on it through `Lease`
//! objects, and of those being released (named in a resume, never reported lost). A lease keeps an `Arc` of its own generation, so its session id stays
//! readable after a reconnect replaced it, and asks here whether that generation is
//! still the live one before it talks to the broker. While a lost session may yet be
//! resumed (the broker restarted with a keeper), it stays the live one, its leases are not
//! lost, and calls wait ([`Generations::settled`]) until it is resumed or given up.
//! Shared by the handle's clones, its leases and the reconnect supervisor; one short
//! lock, never held across an await.

use std::sync::Arc;

use parking_lot::Mutex;

use crate::handshake::Opened;

/// One broker session of a session handle.
#[derive(Debug)]
pub(crate) struct Generation {
    /// 0 for the first broker session, counting up with each re-open.
    number: u64,
    opened: Opened,
}

impl Generation {
    /// What the broker said when it opened this session.
    pub(crate) fn opened(&self) -> &Opened {
        &self.opened
    }

    /// The broker's session id.
    pub(crate) fn id(&self) -> &str {
        &self.opened.id
    }
}

/// The current generation, its connection state and its tracked leases.
pub(crate) struct Generations {
    live: Mutex<Live>,
    /// Bumped on every change of the connection state (waiters look again).
    changed: tokio::sync::watch::Sender<u64>,
}

struct Live {
    current: Arc<Generation>,
    /// False between losing a session and re-opening one.
    connected: bool,
    /// Lost, and being resumed: its leases may still exist.
    resuming: bool,
    /// Ids of the leases of the current generation held through `Lease` objects, in
    /// acquisition order.
    leases: Vec<String>,
    /// Leases of the current generation being released: named in a resume, never
    /// reported lost.
    releasing: Vec<Release>,
}

/// A lease's release under way, or given up while its session is being resumed.
struct Release {
    id: String,
    /// Keeps the mapping: the lease is still mapped, and named held.
    retaining: bool,
    /// Over (given up, unmapped) while the session is being resumed: named let go until
    /// the resume.
    over: bool,
}

impl Live {
    fn is_live(&self, generation: &Generation) -> bool {
        (self.connected || self.resuming) && self.current.number == generation.number
    }
}

impl Generations {
    /// Starts at generation 0, connected.
    pub(crate) fn new(first: Opened) -> Arc<Generations> {
        Arc::new(Generations {
            live: Mutex::new(Live {
                current: Arc::new(Generation {
                    number: 0,
                    opened: first,
                }),
                connected: true,
                resuming: false,
                leases: Vec::new(),
                releasing: Vec::new(),
            }),
            changed: tokio::sync::watch::channel(0).0,
        })
    }

    fn bump(&self) {
        self.changed.send_modify(|n| *n += 1);
    }

    /// Waits (at most `timeout`) while the current session is being resumed; then says
    /// whether it is connected.
    pub(crate) async fn settled(&self, timeout: std::time::Duration) -> bool {
        let mut rx = self.changed.subscribe();
        let wait = async {
            loop {
                {
                    let live = self.live.lock();
                    if live.connected || !live.resuming {
                        return live.connected;
                    }
                }
                if rx.changed().await.is_err() {
                    return false;
                }
            }
        };
        tokio::time::timeout(timeout, wait).await.unwrap_or(false)
    }

    /// Is the current session being resumed?
    pub(crate) fn resuming(&self) -> bool {
        self.live.lock().resuming
    }

    /// The current session was lost and will be resumed: its leases stay live; returns
    /// the ids to name to the broker: those held (with those whose retaining release is
    /// under way: still mapped, the release goes on after the resume), and those let go
    /// (a plain release under way: unmapped and closed).
    pub(crate) fn pause(&self) -> (Vec<String>, Vec<String>) {
        {
            let mut live = self.live.lock();
            live.connected = false;
            live.resuming = true;
        }
        self.bump();
        self.named()
    }

    /// The ids a resume names now: (held, let go), as [`Generations::pause`] says.
    pub(crate) fn named(&self) -> (Vec<String>, Vec<String>) {
        let live = self.live.lock();
        let mut held = live.leases.clone();
        let mut let_go = Vec::new();
        for r in &live.releasing {
            match r.retaining {
                true => held.push(r.id.clone()),
                false => let_go.push(r.id.clone()),
            }
        }
        (held, let_go)
    }

    /// The broker resumed the current session: the leases in `ended` are gone (lost),
    /// the others live on. Returns (kept, lost) among those tracked.
    pub(crate) fn resumed(&self, ended: &[String]) -> (Vec<String>, Vec<String>) {
        let out = {
            let mut live = self.live.lock();
            live.connected = true;
            live.resuming = false;
            live.releasing.retain(|r| !r.over);
            let (lost, kept): (Vec<String>, Vec<String>) =
                live.leases.iter().cloned().partition(|l| ended.contains(l));
            live.leases = kept.clone();
            (kept, lost)
        };
        self.bump();
        out
    }

    /// The current generation (the last one, while disconnected).
    pub(crate) fn current(&self) -> Arc<Generation> {
        self.live.lock().current.clone()
    }

    /// The current generation and whether it is connected.
    pub(crate) fn snapshot(&self) -> (Arc<Generation>, bool) {
        let live = self.live.lock();
        (live.current.clone(), live.connected)
    }

    /// Records a lease acquired on `generation`; false (nothing recorded) when that
    /// session is no longer the live one.
    pub(crate) fn track(&self, generation: &Generation, lease_id: &str) -> bool {
        let mut live = self.live.lock();
        if !live.is_live(generation) {
            return false;
        }
        live.leases.push(lease_id.to_string());
        true
    }

    /// A release of lease `id` of `generation` begins (`retaining`: keeping its mapping);
    /// false (nothing changed) when that session is no longer the live one. Until
    /// [`Generations::end_release`], a resume names it.
    pub(crate) fn begin_release(&self, generation: &Generation, id: &str, retaining: bool) -> bool {
        let mut live = self.live.lock();
        if !live.is_live(generation) {
            return false;
        }
        live.leases.retain(|l| l != id);
        live.releasing.push(Release {
            id: id.to_string(),
            retaining,
            over: false,
        });
        true
    }

    /// The retaining release of lease `id` of `generation` unmapped it after all.
    pub(crate) fn release_unmapped(&self, generation: &Generation, id: &str) {
        let mut live = self.live.lock();
        if live.current.number == generation.number {
            for r in live.releasing.iter_mut().filter(|r| r.id == id) {
                r.retaining = false;
            }
        }
    }

    /// The release of lease `id` of `generation` is over, however it ended (its mapping
    /// gone with it). One given up while the session is being resumed stays named, let
    /// go, until the resume: else the broker would take the lease for one whose grant's
    /// answer was lost.
    pub(crate) fn end_release(&self, generation: &Generation, id: &str) {
        let mut live = self.live.lock();
        if live.current.number != generation.number {
            return;
        }
        if live.resuming {
            for r in live.releasing.iter_mut().filter(|r| r.id == id) {
                (r.retaining, r.over) = (false, true);
            }
        } else {
            live.releasing.retain(|r| r.id != id);
        }
    }

    /// Forgets a lease of `generation` (released, detached or dropped); true when that
    /// session is still the live one, i.e. the lease may still exist on the broker.
    pub(crate) fn untrack(&self, generation: &Generation, lease_id: &str) -> bool {
        let mut live = self.live.lock();
        if !live.is_live(generation) {
            return false;
        }
        if let Some(pos) = live.leases.iter().position(|l| l == lease_id) {
            live.leases.remove(pos);
        }
        true
    }

    /// Whether a lease of `generation` may still exist on the broker.
    pub(crate) fn is_live(&self, generation: &Generation) -> bool {
        self.live.lock().is_live(generation)
    }

    /// The current session is lost: returns the ids of its leases.
    pub(crate) fn disconnect(&self) -> Vec<String> {
        let lost = {
            let mut live = self.live.lock();
            live.connected = false;
            live.resuming = false;
            live.releasing.clear();
            std::mem::take(&mut live.leases)
        };
        self.bump();
        lost
    }

    /// A new broker session replaces the lost one.
    pub(crate) fn connected(&self, opened: Opened) {
        {
            let mut live = self.live.lock();
            let number = live.current.number + 1;
            live.current = Arc::new(Generation { number, opened });
            live.connected = true;
            live.resuming = false;
            live.leases.clear();
            live.releasing.clear();
        }
        self.bump();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opened(id: &str) -> Opened {
        Opened {
            id: id.into(),
            tenant: "t".into(),
            broker_version: "v".into(),
            keepalive_timeout: None,
            peer_pid: 1,
            resume_secret: Default::default(),
        }
    }

    #[test]
    fn leases_die_with_their_generation() {
        let shared = Generations::new(opened("s-1"));
        let (g1, connected) = shared.snapshot();
        assert_eq!((g1.id(), connected), ("s-1", true));
        assert!(shared.track(&g1, "a"));
        assert!(shared.track(&g1, "b"));
        assert!(shared.track(&g1, "c"));
        assert!(shared.untrack(&g1, "b"));
        assert!(shared.is_live(&g1));
        assert_eq!(shared.disconnect(), ["a", "c"]);
        // Between sessions: nothing is live, nothing can be recorded.
        assert!(!shared.is_live(&g1));
        assert!(!shared.track(&g1, "d"));
        assert!(!shared.untrack(&g1, "a"));
        shared.connected(opened("s-2"));
        let (g2, connected) = shared.snapshot();
        assert_eq!((g2.id(), connected), ("s-2", true));
        assert_ne!(g1.number, g2.number);
        assert_eq!(g1.id(), "s-1", "an old generation keeps its id");
        assert!(!shared.is_live(&g1));
        assert!(!shared.untrack(&g1, "c"));
        assert!(!shared.track(&g1, "e"), "a late reply of the old session");
        assert!(shared.track(&g2, "f"));
        assert_eq!(shared.disconnect(), ["f"]);
    }

    /// A session being resumed keeps its leases live; its resume ends those the broker
    /// did not keep; waiters wake on the outcome.
    #[tokio::test]
    async fn a_resumed_session_keeps_its_generation_and_the_leases_the_broker_kept() {
        let shared = Generations::new(opened("s-1"));
        let g1 = shared.current();
        assert!(shared.track(&g1, "a"));
        assert!(shared.track(&g1, "b"));
        assert_eq!(shared.pause().0, ["a", "b"]);
        assert!(
            shared.is_live(&g1),
            "a lease of a session being resumed is not lost"
        );
        assert!(!shared.snapshot().1);
        assert!(shared.resuming());
        let waiter = {
            let s = shared.clone();
            tokio::spawn(async move { s.settled(std::time::Duration::from_secs(5)).await })
        };
        tokio::task::yield_now().await;
        assert_eq!(
            shared.resumed(&["b".to_string()]),
            (vec!["a".to_string()], vec!["b".to_string()])
        );
        assert!(
            waiter.await.unwrap(),
            "the waiter saw the session connected"
        );
        assert!(shared.is_live(&g1) && shared.snapshot().1);
        assert_eq!(shared.disconnect(), ["a"]);
        // Given up: a waiter learns at once that it is not connected.
        assert!(!shared.settled(std::time::Duration::from_secs(5)).await);
    }

    #[test]
    fn a_re_open_with_the_same_id_is_still_a_new_generation() {
        let shared = Generations::new(opened("s-1"));
        let g1 = shared.current();
        assert!(shared.track(&g1, "a"));
        shared.disconnect();
        shared.connected(opened("s-1"));
        assert!(!shared.is_live(&g1));
        assert!(shared.is_live(&shared.current()));
    }

    /// Releases under way are named in a resume (a retaining one's lease as held: still
    /// mapped; a plain one's as let go), are not reported lost, and are named no more
    /// once over.
    #[test]
    fn releases_under_way_are_named_in_a_resume_and_never_lost() {
        let shared = Generations::new(opened("s-1"));
        let g1 = shared.current();
        for id in ["a", "b", "c"] {
            assert!(shared.track(&g1, id));
        }
        assert!(shared.begin_release(&g1, "a", true));
        assert!(shared.begin_release(&g1, "b", false));
        assert_eq!(
            shared.pause(),
            (
                vec!["c".to_string(), "a".to_string()],
                vec!["b".to_string()]
            )
        );
        // Given up while the session is being resumed: named let go until the resume.
        shared.end_release(&g1, "a");
        assert_eq!(
            shared.named(),
            (
                vec!["c".to_string()],
                vec!["a".to_string(), "b".to_string()]
            )
        );
        let (kept, lost) = shared.resumed(&["a".to_string(), "c".to_string()]);
        assert_eq!((kept, lost), (vec![], vec!["c".to_string()]));
        assert_eq!(shared.named(), (vec![], vec!["b".to_string()]));
        shared.end_release(&g1, "b");
        assert_eq!(shared.pause(), (vec![], vec![]));
        shared.connected(opened("s-2"));
        assert!(
            !shared.begin_release(&g1, "c", false),
            "an old session's lease"
        );
    }
}
