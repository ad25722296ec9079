//! One HTTP/2 connection shared by its callers, and who drives it. hyper's connection
//! future and the futures it spawns (the h2 connection, each call's body pipe and
//! response) are kept here instead of on the runtime. A caller alone on the connection
//! polls them itself while it waits for its response, so the reply wakes the thread that
//! waits for it and no other; with several calls in flight, or none, a background task
//! drives them (one task serving every call, as tonic's connection task; it also reads
//! server stream events, PINGs and SETTINGS while nobody calls). Every waker registered
//! inside the connection is the link's own, which forwards to whoever drives now: handing
//! the connection over needs no re-registration.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use futures::task::AtomicWaker;
use parking_lot::{Mutex, MutexGuard};

/// Polls of one drive before it yields to the runtime (a connection kept busy by a fast
/// peer must not starve the driver's own task).
const ROUNDS: usize = 32;

/// How often the background task checks on a driving caller.
const WATCH: std::time::Duration = std::time::Duration::from_millis(20);

/// hyper's connection future, boxed (the link does not depend on the stream type).
pub(crate) type Conn = Pin<Box<dyn Future<Output = hyper::Result<()>> + Send>>;

/// The waker routing and spawn queue shared by the connection's futures and hyper's
/// executor.
pub(crate) struct Hub {
    /// Futures hyper spawned that no drive has picked up yet.
    spawned: Mutex<Vec<BoxFuture<'static, ()>>>,
    /// The current driver's waker: every wake inside the connection ends here.
    driver: AtomicWaker,
    /// Set by every wake, cleared when a drive round starts: work is waiting.
    woken: AtomicBool,
    /// A drive is polling: a wake only sets `woken` (the drive loops on it), no thread.
    in_drive: AtomicBool,
}

impl Hub {
    pub(crate) fn new() -> Arc<Hub> {
        Arc::new(Hub {
            spawned: Mutex::new(Vec::new()),
            driver: AtomicWaker::new(),
            woken: AtomicBool::new(false),
            in_drive: AtomicBool::new(false),
        })
    }
}

impl Wake for Hub {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, SeqCst);
        if !self.in_drive.load(SeqCst) {
            self.driver.wake();
        }
    }
}

/// hyper's executor for the connection: queues futures for the drivers, spawns nothing.
#[derive(Clone)]
pub(crate) struct Exec(pub(crate) Arc<Hub>);

impl<F: Future<Output = ()> + Send + 'static> hyper::rt::Executor<F> for Exec {
    fn execute(&self, fut: F) {
        self.0.spawned.lock().push(Box::pin(fut));
        self.0.wake_by_ref();
    }
}

/// Who polls the connection now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Driver {
    /// The background task.
    Background,
    /// The one caller in flight, while it waits for its response headers.
    Caller(u64),
    /// A response body, for the length of one poll (it may not be polled again soon).
    Body,
}

struct Roles {
    driver: Driver,
    /// Calls in flight (made and not yet answered or dropped).
    calls: usize,
    /// The background task ticks (`Link::watch`).
    watching: bool,
    /// The background task's waker, once it has run.
    background: Option<Waker>,
}

/// The connection and its futures.
struct Parts {
    /// hyper's connection future; `None` once it ended.
    conn: Option<Conn>,
    tasks: FuturesUnordered<BoxFuture<'static, ()>>,
}

/// One HTTP/2 connection and its drivers.
pub(crate) struct Link {
    hub: Arc<Hub>,
    /// `hub` as a waker: the context every future of the connection is polled with.
    waker: Waker,
    parts: Mutex<Parts>,
    roles: Mutex<Roles>,
    next_id: AtomicU64,
    /// Drives so far (the background task's watch on a driving caller).
    drives: AtomicU64,
    /// The connection and every future it spawned have finished.
    ended: AtomicBool,
}

impl Link {
    pub(crate) fn new(hub: Arc<Hub>, conn: Conn) -> Arc<Link> {
        Arc::new(Link {
            waker: Waker::from(hub.clone()),
            hub,
            parts: Mutex::new(Parts {
                conn: Some(conn),
                tasks: FuturesUnordered::new(),
            }),
            roles: Mutex::new(Roles {
                driver: Driver::Background,
                calls: 0,
                watching: false,
                background: None,
            }),
            next_id: AtomicU64::new(0),
            drives: AtomicU64::new(0),
            ended: AtomicBool::new(false),
        })
    }

    /// Has the connection ended (closed by either side, or broken)?
    pub(crate) fn ended(&self) -> bool {
        self.ended.load(SeqCst)
    }

    /// A new call in flight: its id.
    pub(crate) fn caller(&self) -> u64 {
        self.roles.lock().calls += 1;
        self.next_id.fetch_add(1, SeqCst)
    }

    /// Call `id` drives the connection if it already does, or if it is the only call in
    /// flight (`waker`: where the connection's wakes go then). Returns whether it drives;
    /// if not, the background task's polls answer it.
    pub(crate) fn take(&self, id: u64, waker: &Waker) -> bool {
        let mut r = self.roles.lock();
        let drives = match r.driver {
            Driver::Caller(d) if d == id => true,
            Driver::Caller(_) => {
                // Several calls now: the background task serves them all (the driving
                // caller's owner may be awaiting this call, not polling its own).
                self.to_background(&mut r);
                false
            }
            Driver::Background | Driver::Body => r.calls == 1,
        };
        if drives {
            if !r.watching {
                // The first call after a quiet spell starts the background task's watch.
                r.watching = true;
                if let Some(bg) = &r.background {
                    bg.wake_by_ref();
                }
            }
            r.driver = Driver::Caller(id);
            // Registered under the lock: wakes follow the order of the hand-overs.
            self.hub.driver.register(waker);
        }
        drives
    }

    /// Call `id` is done (answered, failed or dropped); if it drives, the background
    /// task takes over.
    pub(crate) fn leave(&self, id: u64) {
        let mut r = self.roles.lock();
        r.calls -= 1;
        if r.driver == Driver::Caller(id) {
            self.to_background(&mut r);
        }
    }

    /// Hands the connection to the background task, woken only if work is waiting (or the
    /// connection ended): its waker is registered everywhere a wake would come from.
    fn to_background(&self, r: &mut Roles) {
        r.driver = Driver::Background;
        if let Some(bg) = &r.background {
            self.hub.driver.register(bg);
            if self.hub.woken.load(SeqCst) || self.ended() {
                bg.wake_by_ref();
            }
        }
    }

    /// A response body drives the connection once if no call is in flight and nothing else
    /// drives: while it waits for frames (`waker`: its own, for what this drive leaves
    /// waiting; the next frames usually came in the same read as the headers), or when it
    /// is dropped (`first`: the drop, whose wake to the connection then needs no
    /// background thread). With calls in flight the background task drives for them all.
    pub(crate) fn drive_if_idle(&self, waker: Option<&Waker>, first: impl FnOnce()) {
        let parts = {
            let mut r = self.roles.lock();
            let parts = (r.driver == Driver::Background && r.calls == 0)
                .then(|| self.parts.try_lock())
                .flatten();
            let Some(parts) = parts else {
                drop(r);
                first();
                return;
            };
            r.driver = Driver::Body;
            if let Some(waker) = waker {
                self.hub.driver.register(waker);
            }
            parts
        };
        self.drive_locked(parts, first);
        let mut r = self.roles.lock();
        if r.driver == Driver::Body {
            self.to_background(&mut r);
        }
    }

    /// Polls the connection and its futures until nothing is left to do now; `first` runs
    /// inside the drive (a wake it causes wakes no thread). Returns whether the
    /// connection has ended.
    pub(crate) fn drive(&self, first: impl FnOnce()) -> bool {
        self.drive_locked(self.parts.lock(), first)
    }

    fn drive_locked(&self, mut parts: MutexGuard<'_, Parts>, first: impl FnOnce()) -> bool {
        self.drives.fetch_add(1, SeqCst);
        let mut cx = Context::from_waker(&self.waker);
        self.hub.in_drive.store(true, SeqCst);
        first();
        let mut rounds = 0;
        loop {
            self.hub.woken.store(false, SeqCst);
            if let Some(conn) = parts.conn.as_mut() {
                if let Poll::Ready(r) = conn.as_mut().poll(&mut cx) {
                    if let Err(e) = r {
                        tracing::debug!("broker connection ended: {e}");
                    }
                    parts.conn = None;
                }
            }
            let spawned = std::mem::take(&mut *self.hub.spawned.lock());
            parts.tasks.extend(spawned);
            while let Poll::Ready(Some(())) = parts.tasks.poll_next_unpin(&mut cx) {}
            if !self.hub.woken.load(SeqCst) {
                self.hub.in_drive.store(false, SeqCst);
                // A wake between the check and the store found `in_drive` still set.
                if !self.hub.woken.load(SeqCst) {
                    break;
                }
                self.hub.in_drive.store(true, SeqCst);
            }
            rounds += 1;
            if rounds == ROUNDS {
                self.hub.in_drive.store(false, SeqCst);
                // Still busy: let the driver's task yield and come back.
                self.hub.woken.store(true, SeqCst);
                self.hub.driver.wake();
                break;
            }
        }
        let ended =
            parts.conn.is_none() && parts.tasks.is_empty() && self.hub.spawned.lock().is_empty();
        if ended {
            self.ended.store(true, SeqCst);
        }
        ended
    }

    /// The background driver: drives while no caller does, ends with the connection.
    pub(crate) async fn background(self: Arc<Link>) {
        // While calls come: a timer, and the drive and call counts at its last tick.
        let mut watch: Option<(Pin<Box<tokio::time::Sleep>>, u64, u64)> = None;
        futures::future::poll_fn(|cx| {
            {
                let mut r = self.roles.lock();
                if !r
                    .background
                    .as_ref()
                    .is_some_and(|w| w.will_wake(cx.waker()))
                {
                    r.background = Some(cx.waker().clone());
                }
                if self.ended() {
                    return Poll::Ready(());
                }
                if r.watching {
                    self.watch(&mut r, &mut watch, cx);
                }
                if !r.watching {
                    watch = None;
                }
                if r.driver != Driver::Background {
                    return Poll::Pending;
                }
                self.hub.driver.register(cx.waker());
            }
            if self.drive(|| ()) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
        tracing::debug!("broker connection closed");
    }

    /// The background task's tick while calls come: a caller's future kept but not polled
    /// (its owner awaits something else) would hold the connection up, so a caller that
    /// let work wait a whole tick with no drive loses the connection to the background
    /// task; a tick with no call in flight and none started ends the watch.
    fn watch(
        &self,
        r: &mut Roles,
        watch: &mut Option<(Pin<Box<tokio::time::Sleep>>, u64, u64)>,
        cx: &mut Context<'_>,
    ) {
        let (tick, seen_drives, seen_calls) = watch.get_or_insert_with(|| {
            let tick = Box::pin(tokio::time::sleep(WATCH));
            (tick, u64::MAX, u64::MAX)
        });
        while tick.as_mut().poll(cx).is_ready() {
            tick.as_mut().reset(tokio::time::Instant::now() + WATCH);
            let drives = self.drives.load(SeqCst);
            let started = self.next_id.load(SeqCst);
            let stalled = self.hub.woken.load(SeqCst) && *seen_drives == drives;
            if r.driver != Driver::Background && stalled {
                tracing::debug!("the caller driving the broker connection is not polled");
                r.driver = Driver::Background;
            }
            if r.calls == 0 && *seen_calls == started {
                r.watching = false;
                return;
            }
            (*seen_drives, *seen_calls) = (drives, started);
        }
    }
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("ended", &self.ended())
            .finish_non_exhaustive()
    }
}
