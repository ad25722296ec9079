//! The store writer: one named OS thread that runs durable operator changes (a store
//! commit with fsync, and what goes with it) one at a time, in the order they were asked
//! for. An RPC hands its change over and awaits the answer, so no tokio worker blocks in
//! a commit and none is handed off (`block_in_place`) per write. The thread enters the
//! runtime it was started from, so a change may spawn tasks (the effects of a queue run).
//! Stopping closes the queue: changes asked for before still run, then the thread ends
//! and is joined.

use parking_lot::Mutex;
use std::sync::mpsc;
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

/// The writer thread and its queue.
#[derive(Debug)]
pub struct StoreWriter {
    tx: Mutex<Option<mpsc::Sender<Job>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl StoreWriter {
    /// Starts the thread `name`, inside the current tokio runtime if there is one.
    pub fn start(name: &str) -> std::io::Result<StoreWriter> {
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
            thread: Mutex::new(Some(thread)),
        })
    }

    /// A writer that has stopped without ever starting: every [`StoreWriter::run`] gets
    /// [`WriterError::Stopped`].
    pub fn stopped() -> StoreWriter {
        StoreWriter {
            tx: Mutex::new(None),
            thread: Mutex::new(None),
        }
    }

    /// Runs `f` on the writer thread after every change asked for before it; its result.
    /// The change runs to its end even if the caller stops waiting.
    pub async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, WriterError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
                .map_err(|p| WriterError::Panicked(panic_text(&p)));
            let _ = reply.send(r);
        });
        {
            let tx = self.tx.lock();
            let tx = tx.as_ref().ok_or(WriterError::Stopped)?;
            tx.send(job).map_err(|_| WriterError::Stopped)?;
        }
        answer.await.map_err(|_| WriterError::Stopped)?
    }

    /// Closes the queue and waits for the changes already in it and the thread's end
    /// (not when called on the writer thread itself: it ends once the current change
    /// returns). Later [`StoreWriter::run`] calls get [`WriterError::Stopped`].
    pub fn stop(&self) {
        drop(self.tx.lock().take());
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

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

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
        let stopper = {
            let w = w.clone();
            std::thread::spawn(move || w.stop())
        };
        go.send(()).unwrap();
        stopper.join().unwrap();
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
}
