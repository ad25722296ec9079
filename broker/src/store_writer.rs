//! The store writer: one named OS thread that runs durable operator changes (a store
//! commit with fsync, and what goes with it) one at a time, in the order they were asked
//! for. An RPC hands its change over and awaits the answer, so no tokio worker blocks in
//! a commit and none is handed off (`block_in_place`) per write. The thread enters the
//! runtime it was started from, so a change may spawn tasks (the effects of a queue run).
//! Stopping closes the queue: changes asked for before still run, then the thread ends
//! and is joined.
//!
//! The queue is bounded ([`DEFAULT_QUEUE`] changes handed over and not yet done): a caller
//! past the bound waits for room before its change is handed over, so callers that give
//! up and ask again cannot grow it. Work nobody awaits ([`StoreWriter::submit`], an
//! audit record) takes a place too, waiting for one on its calling thread. Each change runs inside the caller's tracing span
//! (an RPC's `rpc{method=...}`), so what it logs reads as the RPC's.

use parking_lot::Mutex;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

/// Why a change handed to the writer got no answer.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WriterError {
    /// The writer stopped (shutdown) before it took the change.
    #[error("the store writer has stopped")]
    Stopped,
    /// The change panicked (the writer goes on with the next one).
    #[error("a durable change panicked: {0}")]
    Panicked(String),
}

type Job = Box<dyn FnOnce() + Send + 'static>;

/// Changes handed over and not yet done, at most (see [`StoreWriter::with_queue`]).
pub const DEFAULT_QUEUE: usize = 256;

/// The writer thread and its queue.
#[derive(Debug)]
pub struct StoreWriter {
    tx: Mutex<Option<mpsc::Sender<Job>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// One permit per change in the queue or running ([`DEFAULT_QUEUE`] in all).
    room: Arc<tokio::sync::Semaphore>,
    /// The writer thread's id (None: never started).
    thread_id: Option<std::thread::ThreadId>,
}

impl StoreWriter {
    /// Starts the thread `name`, inside the current tokio runtime if there is one.
    pub fn start(name: &str) -> std::io::Result<StoreWriter> {
        Self::with_queue(name, DEFAULT_QUEUE)
    }

    /// [`StoreWriter::start`] with room for `queue` changes (at least one).
    pub fn with_queue(name: &str, queue: usize) -> std::io::Result<StoreWriter> {
        let (tx, rx) = mpsc::channel::<Job>();
        let rt = tokio::runtime::Handle::try_current().ok();
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                let _rt = rt.as_ref().map(|h| h.enter());
                while let Ok(job) = rx.recv() {
                    job();
                }
            })?;
        Ok(StoreWriter {
            tx: Mutex::new(Some(tx)),
            thread_id: Some(thread.thread().id()),
            thread: Mutex::new(Some(thread)),
            room: Arc::new(tokio::sync::Semaphore::new(queue.max(1))),
        })
    }

    /// A writer that has stopped without ever starting: every [`StoreWriter::run`] gets
    /// [`WriterError::Stopped`].
    pub fn stopped() -> StoreWriter {
        StoreWriter {
            tx: Mutex::new(None),
            thread: Mutex::new(None),
            room: Arc::new(tokio::sync::Semaphore::new(1)),
            thread_id: None,
        }
    }

    /// Runs `f` on the writer thread after every change asked for before it; its result.
    /// Waits for room in the queue first (a caller that gives up while waiting hands
    /// nothing over). Once handed over, the change runs to its end even if the caller
    /// stops waiting.
    pub async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, WriterError> {
        let permit = self
            .room
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| WriterError::Stopped)?;
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.hand_over(None, move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
                .map_err(|p| WriterError::Panicked(panic_text(&p)));
            // Its place is free before its caller hears back.
            drop(permit);
            let _ = reply.send(r);
        })?;
        answer.await.map_err(|_| WriterError::Stopped)?
    }

    /// Hands `f` to the writer thread (after every change asked for before it) and
    /// returns without waiting for it to run; a panic in it is logged. For work nobody
    /// awaits (the audit record of a change made elsewhere). It takes a place in the queue
    /// as [`StoreWriter::run`] does: when the queue is full it waits for room on the
    /// calling thread (in `block_in_place` on a multi-threaded runtime's worker), so
    /// callers that hand work over and go away (an operator's RPC cancelled after its
    /// change) cannot grow the queue. Work submitted by a change running on the writer
    /// itself does not wait (it would wait for itself): one job adds at most what it
    /// submits.
    pub fn submit(&self, f: impl FnOnce() + Send + 'static) -> Result<(), WriterError> {
        use tokio::sync::TryAcquireError;
        let permit = match self.room.clone().try_acquire_owned() {
            Ok(p) => Some(p),
            Err(TryAcquireError::Closed) => return Err(WriterError::Stopped),
            Err(TryAcquireError::NoPermits) if self.on_writer() => None,
            Err(TryAcquireError::NoPermits) => Some(self.wait_for_room()?),
        };
        self.hand_over(permit, move || {
            if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
                tracing::error!(why = %panic_text(&p), "a store-writer job panicked");
            }
        })
    }

    /// Whether this is the writer thread.
    fn on_writer(&self) -> bool {
        self.thread_id == Some(std::thread::current().id())
    }

    /// Blocks the calling thread until the queue has room (`Stopped` once it closed).
    fn wait_for_room(&self) -> Result<tokio::sync::OwnedSemaphorePermit, WriterError> {
        let room = self.room.clone();
        off_the_runtime(|| {
            futures::executor::block_on(room.acquire_owned()).map_err(|_| WriterError::Stopped)
        })
    }

    /// Queues `job`, to run inside the caller's tracing span; `permit` (its place in the
    /// queue) is given back once it has run. It logs through the caller's dispatcher too.
    fn hand_over(
        &self,
        permit: Option<tokio::sync::OwnedSemaphorePermit>,
        job: impl FnOnce() + Send + 'static,
    ) -> Result<(), WriterError> {
        let span = tracing::Span::current();
        let dispatch = tracing::dispatcher::get_default(|d| d.clone());
        let job: Job = Box::new(move || {
            tracing::dispatcher::with_default(&dispatch, || {
                let _in_span = span.enter();
                job();
            });
            drop(permit);
        });
        let tx = self.tx.lock();
        let tx = tx.as_ref().ok_or(WriterError::Stopped)?;
        tx.send(job).map_err(|_| WriterError::Stopped)
    }

    /// Closes the queue and waits for the changes already in it and the thread's end
    /// (not when called on the writer thread itself: it ends once the current change
    /// returns). Later [`StoreWriter::run`] calls get [`WriterError::Stopped`].
    pub fn stop(&self) {
        drop(self.tx.lock().take());
        self.room.close();
        let thread = self.thread.lock().take();
        if let Some(t) = thread {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

impl Drop for StoreWriter {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Runs blocking work (a wait, a commit): inside `block_in_place` on a multi-threaded
/// tokio runtime's worker, so that worker's other tasks move elsewhere meanwhile; as is
/// elsewhere (current-thread runtimes, plain threads, the writer itself).
pub(crate) fn off_the_runtime<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::pin::Pin;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn changes_run_in_order_on_the_named_thread() {
        let w = StoreWriter::start("test-writer").unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut pending = Vec::new();
        for i in 0..50 {
            let s = seen.clone();
            pending.push(w.run(move || {
                s.lock().push(i);
                std::thread::current().name().map(str::to_string)
            }));
        }
        for p in futures::future::join_all(pending).await {
            assert_eq!(p.unwrap().as_deref(), Some("test-writer"));
        }
        assert_eq!(*seen.lock(), (0..50).collect::<Vec<_>>());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panicking_change_is_an_error_and_the_writer_goes_on() {
        let w = StoreWriter::start("test-writer").unwrap();
        let r: Result<(), _> = w.run(|| panic!("disk on fire")).await;
        assert_eq!(r, Err(WriterError::Panicked("disk on fire".into())));
        assert_eq!(w.run(|| 7).await, Ok(7));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_change_can_spawn_on_the_runtime() {
        let w = StoreWriter::start("test-writer").unwrap();
        let task = w.run(|| tokio::spawn(async { 41 + 1 })).await.unwrap();
        assert_eq!(task.await.unwrap(), 42);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn blocking_work_inside_a_change_runs_in_place() {
        // `block_in_place` (what the arbiter's commits use on a runtime worker) runs the
        // closure directly on the writer, which is no worker.
        let w = StoreWriter::start("test-writer").unwrap();
        assert_eq!(w.run(|| tokio::task::block_in_place(|| 5)).await, Ok(5));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stop_finishes_what_was_asked_then_refuses() {
        let w = Arc::new(StoreWriter::start("test-writer").unwrap());
        let done = Arc::new(Mutex::new(0u32));
        // The first change holds the thread until told; five more are handed over
        // behind it (each future polled once), then the writer is told to stop.
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let mut first = Box::pin(w.run(move || wait.recv().is_ok()));
        assert!(futures::poll!(&mut first).is_pending());
        let mut queued = Vec::new();
        for _ in 0..5 {
            let d = done.clone();
            let mut q = Box::pin(w.run(move || *d.lock() += 1));
            assert!(futures::poll!(&mut q).is_pending());
            queued.push(q);
        }
        stop_while_held(&w, &go);
        assert_eq!(first.await, Ok(true));
        for q in queued {
            assert_eq!(q.await, Ok(()), "asked before the stop: done");
        }
        assert_eq!(*done.lock(), 5);
        assert_eq!(w.run(|| ()).await, Err(WriterError::Stopped));
        assert!(w.thread.lock().is_none(), "joined");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_last_owner_dropped_on_the_writer_itself_does_not_deadlock() {
        let w = Arc::new(StoreWriter::start("test-writer").unwrap());
        let last = w.clone();
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let mut asked = Box::pin(w.run(move || {
            wait.recv().unwrap();
            // The last reference: dropping it stops the writer from its own thread.
            drop(last);
            let _ = tx.send(std::thread::current().name().map(str::to_string));
        }));
        // Polled once: the change is handed over; then the caller goes away.
        assert!(futures::poll!(&mut asked).is_pending());
        drop(asked);
        drop(w);
        go.send(()).unwrap();
        let name = tokio::time::timeout(std::time::Duration::from_secs(10), rx)
            .await
            .expect("the writer did not deadlock")
            .unwrap();
        assert_eq!(name.as_deref(), Some("test-writer"));
    }

    /// Stops `w` from another thread while the change holding it waits for `go`, then sends
    /// `go`; returns once the writer has stopped.
    fn stop_while_held(w: &Arc<StoreWriter>, go: &mpsc::Sender<()>) {
        let stopper = {
            let w = w.clone();
            std::thread::spawn(move || w.stop())
        };
        go.send(()).unwrap();
        stopper.join().unwrap();
    }

    /// Takes both places of `w` (room for two): a change that holds the thread until `go`
    /// (the sender returned) is sent, then pushes 1 to `ran`, and one that pushes 2 queued
    /// behind it; both handed over (polled once).
    async fn both_places_taken<'w>(
        w: &'w StoreWriter,
        ran: &Arc<Mutex<Vec<i32>>>,
    ) -> (
        mpsc::Sender<()>,
        Pin<Box<impl Future<Output = Result<(), WriterError>> + 'w>>,
        Pin<Box<impl Future<Output = Result<(), WriterError>> + 'w>>,
    ) {
        let (go, wait) = mpsc::channel::<()>();
        let r = ran.clone();
        let mut first = Box::pin(w.run(move || {
            wait.recv().unwrap();
            r.lock().push(1);
        }));
        assert!(futures::poll!(&mut first).is_pending());
        let r = ran.clone();
        let mut second = Box::pin(w.run(move || r.lock().push(2)));
        assert!(futures::poll!(&mut second).is_pending());
        (go, first, second)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn callers_past_the_queue_bound_wait_and_those_that_give_up_hand_nothing_over() {
        let w = StoreWriter::with_queue("test-writer", 2).unwrap();
        let ran = Arc::new(Mutex::new(Vec::new()));
        let (go, first, second) = both_places_taken(&w, &ran).await;
        // A hundred callers that ask and give up (an RPC cancelled and sent again): none
        // finds room, so none is handed over.
        for i in 0..100 {
            let r = ran.clone();
            let mut gave_up = Box::pin(w.run(move || r.lock().push(100 + i)));
            assert!(futures::poll!(&mut gave_up).is_pending());
        }
        assert_eq!(w.room.available_permits(), 0);
        // One that waits gets its turn once there is room.
        let r = ran.clone();
        let mut third = Box::pin(w.run(move || r.lock().push(3)));
        assert!(futures::poll!(&mut third).is_pending());
        go.send(()).unwrap();
        first.await.unwrap();
        second.await.unwrap();
        third.await.unwrap();
        assert_eq!(
            *ran.lock(),
            vec![1, 2, 3],
            "only the callers that waited ran"
        );
        assert_eq!(w.room.available_permits(), 2, "every place given back");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn submitted_work_runs_in_order_without_being_awaited() {
        let w = StoreWriter::with_queue("test-writer", 1).unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        for i in 0..5 {
            let s = seen.clone();
            // Past the bound: each waits for the one before to have run.
            w.submit(move || s.lock().push(i)).unwrap();
        }
        w.submit(|| panic!("logged, not fatal")).unwrap();
        let s = seen.clone();
        assert_eq!(
            w.run(move || s.lock().clone()).await,
            Ok(vec![0, 1, 2, 3, 4])
        );
        w.stop();
        assert_eq!(w.submit(|| ()), Err(WriterError::Stopped));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn submitted_work_past_the_bound_waits_for_room() {
        let w = Arc::new(StoreWriter::with_queue("test-writer", 2).unwrap());
        let ran = Arc::new(Mutex::new(Vec::new()));
        let (go, first, second) = both_places_taken(&w, &ran).await;
        // Four submitters (an RPC that recorded and went away, four times) wait for room
        // on their threads instead of growing the queue.
        let (returned, submitted) = std::sync::mpsc::channel::<i32>();
        let submitters: Vec<_> = (0..4)
            .map(|i| {
                let (w, r, returned) = (w.clone(), ran.clone(), returned.clone());
                std::thread::spawn(move || {
                    w.submit(move || r.lock().push(10 + i)).unwrap();
                    returned.send(i).unwrap();
                })
            })
            .collect();
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(submitted.try_recv().is_err(), "none was handed over");
        assert_eq!(w.room.available_permits(), 0);
        go.send(()).unwrap();
        first.await.unwrap();
        second.await.unwrap();
        for s in submitters {
            s.join().unwrap();
        }
        let r = ran.clone();
        let mut seen = w.run(move || r.lock().clone()).await.unwrap();
        assert_eq!(seen[..2], [1, 2], "the changes asked for first ran first");
        seen[2..].sort();
        assert_eq!(seen[2..], [10, 11, 12, 13], "every submitted record ran");
        // A place is given back just after its job answered: wait (bounded) for both.
        for _ in 0..10_000 {
            if w.room.available_permits() == 2 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(w.room.available_permits(), 2, "every place given back");
        // A submitter waiting when the writer stops is told so (the caller writes its
        // record itself).
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let mut held = Box::pin(w.run(move || wait.recv().is_ok()));
        assert!(futures::poll!(&mut held).is_pending());
        let mut queued = Box::pin(w.run(|| ()));
        assert!(futures::poll!(&mut queued).is_pending());
        let late = {
            let w = w.clone();
            std::thread::spawn(move || w.submit(|| ()))
        };
        std::thread::sleep(std::time::Duration::from_millis(20));
        stop_while_held(&w, &go);
        assert_eq!(held.await, Ok(true));
        let late = late.join().unwrap();
        // It waited (stopped) or got the place the stop freed as the writer ended.
        assert!(
            matches!(late, Err(WriterError::Stopped) | Ok(())),
            "{late:?}"
        );
        let _ = queued.await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_change_that_submits_on_a_full_queue_does_not_wait_for_itself() {
        let w = Arc::new(StoreWriter::with_queue("test-writer", 1).unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (me, s) = (w.clone(), seen.clone());
        // The change holds the only place; what it submits goes behind it.
        let change = w.run(move || {
            let s2 = s.clone();
            me.submit(move || s2.lock().push("record")).unwrap();
            s.lock().push("change");
        });
        tokio::time::timeout(std::time::Duration::from_secs(10), change)
            .await
            .expect("the writer did not wait for itself")
            .unwrap();
        let s = seen.clone();
        assert_eq!(
            w.run(move || s.lock().clone()).await.unwrap(),
            ["change", "record"]
        );
    }

    /// Each event's message and the span it was logged in (`name{field=value ...}`).
    type Seen = Arc<Mutex<Vec<(String, Option<String>)>>>;

    /// A tracing layer that collects, for each event, its message and its span.
    struct SpanOfEvents(Seen);

    /// A span's fields as text (kept in the span's extensions).
    struct Fields(String);

    #[derive(Default)]
    struct Text(String);

    impl tracing::field::Visit for Text {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            if !self.0.is_empty() {
                self.0.push(' ');
            }
            if field.name() == "message" {
                self.0.push_str(&format!("{value:?}"));
            } else {
                self.0.push_str(&format!("{}={value:?}", field.name()));
            }
        }
    }

    /// An event's message only.
    #[derive(Default)]
    struct Message(String);

    impl tracing::field::Visit for Message {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            if field.name() == "message" {
                self.0 = format!("{value:?}");
            }
        }
    }

    impl<S> tracing_subscriber::Layer<S> for SpanOfEvents
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        fn on_new_span(
            &self,
            attrs: &tracing::span::Attributes<'_>,
            id: &tracing::span::Id,
            ctx: tracing_subscriber::layer::Context<'_, S>,
        ) {
            let mut text = Text::default();
            attrs.record(&mut text);
            if let Some(span) = ctx.span(id) {
                span.extensions_mut()
                    .insert(Fields(format!("{}{{{}}}", span.name(), text.0)));
            }
        }

        fn on_event(
            &self,
            event: &tracing::Event<'_>,
            ctx: tracing_subscriber::layer::Context<'_, S>,
        ) {
            let mut message = Message::default();
            event.record(&mut message);
            let message = message.0;
            let span = ctx
                .event_span(event)
                .and_then(|s| s.extensions().get::<Fields>().map(|f| f.0.clone()));
            self.0.lock().push((message, span));
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_change_logs_in_the_callers_span() {
        use tracing::Instrument;
        use tracing_subscriber::layer::SubscriberExt;
        let seen = Arc::new(Mutex::new(Vec::new()));
        let subscriber = tracing_subscriber::registry().with(SpanOfEvents(seen.clone()));
        let dispatch = tracing::Dispatch::new(subscriber);
        let w = StoreWriter::start("test-writer").unwrap();
        let _default = tracing::dispatcher::set_default(&dispatch);
        w.run(|| tracing::info!("committed"))
            .instrument(tracing::info_span!("rpc", method = "SetQuota"))
            .await
            .unwrap();
        w.submit(|| tracing::info!("unawaited")).unwrap();
        w.run(|| ()).await.unwrap();
        let seen = seen.lock().clone();
        assert!(
            seen.contains(&("committed".into(), Some("rpc{method=\"SetQuota\"}".into()))),
            "{seen:?}"
        );
        assert!(seen.contains(&("unawaited".into(), None)), "{seen:?}");
    }
}
