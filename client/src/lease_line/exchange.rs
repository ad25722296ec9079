//! One request and its answer on a lease line, on either of the two wires a line can be:
//! registered with the runtime (a caller inside a task awaits the answer) or not (a caller
//! outside any task, a thread in `block_on` as Python's is, waits for it itself, woken by
//! the kernel instead of a runtime thread: one thread switch fewer a request; an answer
//! slower than [`THREAD_WAIT`] is awaited on the runtime, cancellable). Both read the
//! answer whole as it comes (one read, as a rule) and judge it alike.

use crate::error::ClientError;
use gpu_broker_proto::ticket::{
    line_frame, line_payload_len, LINE_FRAME_HEAD, LINE_GRANTED, LINE_MAX_PAYLOAD, LINE_NOT_HERE,
    LINE_RELEASED,
};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream as StdStream;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// How long a caller waits for an answer on its own thread (it cannot be cancelled
/// meanwhile) before awaiting the rest on the runtime: the broker answers at once, as a
/// rule, in microseconds.
pub const THREAD_WAIT: Duration = match cfg!(test) {
    // Long enough for a test's stand-in broker on a loaded machine.
    true => Duration::from_secs(30),
    false => Duration::from_millis(20),
};
/// How long a request's frame may take to go out on the caller's thread (a socket buffer
/// holds many; a frame not sent whole is not served: the broker drops a cut one).
const SEND_WAIT: Duration = Duration::from_secs(1);

/// How a request on the line came out.
pub(super) enum Asked {
    /// Answered with this kind and payload.
    Answered(u8, Vec<u8>),
    /// Not served: it could not be sent, or the line ended before any answer (the broker
    /// closes a line only before reading a request, or on a malformed one).
    NotSent,
}

/// An answer as it comes in: what came so far.
pub(super) struct Answer {
    buf: Vec<u8>,
    got: usize,
}

/// How a request made on the caller's thread came out.
pub(super) enum OnThread {
    Done(Result<Asked, ClientError>),
    /// Sent, its answer not (all) in within the wait: the rest to await.
    Waiting(Answer),
}

impl Answer {
    fn new() -> Answer {
        Answer {
            buf: vec![0u8; LINE_FRAME_HEAD + LINE_MAX_PAYLOAD],
            got: 0,
        }
    }

    /// The answer once `got` bytes of it are in: `None` while more are to come.
    fn whole(&self, got: usize) -> Result<Option<Asked>, ClientError> {
        if got < LINE_FRAME_HEAD {
            return Ok(None);
        }
        let mut head = [0u8; LINE_FRAME_HEAD];
        head.copy_from_slice(&self.buf[..LINE_FRAME_HEAD]);
        let len = line_payload_len(&head).ok_or_else(|| broken("is too long"))?;
        if !matches!(head[0], LINE_GRANTED | LINE_RELEASED | LINE_NOT_HERE) {
            return Err(broken(&format!("is of unknown kind {:#x}", head[0])));
        }
        let end = LINE_FRAME_HEAD + len;
        match got.cmp(&end) {
            std::cmp::Ordering::Less => Ok(None),
            // One request, one answer: anything past it is not the broker's protocol.
            std::cmp::Ordering::Greater => Err(broken("runs past its length")),
            std::cmp::Ordering::Equal => Ok(Some(Asked::Answered(
                head[0],
                self.buf[LINE_FRAME_HEAD..end].to_vec(),
            ))),
        }
    }

    /// The line closed after `got` bytes: nothing sent back is a request not served, a part
    /// of an answer an error (the broker may have done it).
    fn closed(got: usize) -> Result<Asked, ClientError> {
        match got {
            0 => Ok(Asked::NotSent),
            _ => Err(broken("broke off")),
        }
    }
}

fn broken(what: &str) -> ClientError {
    ClientError::Protocol(format!("a lease line's answer {what}"))
}

/// Sends one request and reads its answer, awaiting both on the runtime. No deadline, as a
/// gRPC call has none.
pub(super) async fn on_runtime(
    stream: &mut UnixStream,
    kind: u8,
    body: &[u8],
) -> Result<Asked, ClientError> {
    if stream.write_all(&line_frame(kind, body)).await.is_err() {
        return Ok(Asked::NotSent);
    }
    awaited(stream, Answer::new()).await
}

/// Awaits the rest of `answer` on the runtime.
pub(super) async fn awaited(
    stream: &mut UnixStream,
    mut answer: Answer,
) -> Result<Asked, ClientError> {
    loop {
        let got = answer.got;
        let n = match stream.read(&mut answer.buf[got..]).await {
            Ok(0) | Err(_) => return Answer::closed(got),
            Ok(n) => n,
        };
        answer.got += n;
        if let Some(asked) = answer.whole(answer.got)? {
            return Ok(asked);
        }
    }
}

/// Sends one request and reads its answer on this thread, which sleeps in the kernel until
/// the answer comes (the socket stays non-blocking: it may go back to the runtime), at most
/// `wait` ([`THREAD_WAIT`]).
pub(super) fn on_thread(stream: &mut StdStream, kind: u8, body: &[u8], wait: Duration) -> OnThread {
    let frame = line_frame(kind, body);
    let send_by = Instant::now() + SEND_WAIT;
    let mut sent = 0;
    while sent < frame.len() {
        match stream.write(&frame[sent..]) {
            Ok(0) => return OnThread::Done(Ok(Asked::NotSent)),
            Ok(n) => sent += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if !wait_for(stream, rustix::event::PollFlags::OUT, send_by) {
                    return OnThread::Done(Ok(Asked::NotSent));
                }
            }
            Err(_) => return OnThread::Done(Ok(Asked::NotSent)),
        }
    }
    let deadline = Instant::now() + wait;
    let mut answer = Answer::new();
    loop {
        // The answer is not there yet, as a rule: wait first, then read it whole.
        if !wait_for(stream, rustix::event::PollFlags::IN, deadline) {
            return OnThread::Waiting(answer);
        }
        let got = answer.got;
        match stream.read(&mut answer.buf[got..]) {
            Ok(0) => return OnThread::Done(Answer::closed(got)),
            Ok(n) => answer.got += n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {
                continue
            }
            Err(_) => return OnThread::Done(Answer::closed(got)),
        }
        match answer.whole(answer.got) {
            Ok(None) => {}
            Ok(Some(asked)) => return OnThread::Done(Ok(asked)),
            Err(e) => return OnThread::Done(Err(e)),
        }
    }
}

/// Sleeps until `stream` is ready for `flags` (or closed, or in error: the next read or
/// write says which); `false` when `deadline` passed first.
fn wait_for(stream: &StdStream, flags: rustix::event::PollFlags, deadline: Instant) -> bool {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        let timeout = rustix::event::Timespec::try_from(left).unwrap_or(rustix::event::Timespec {
            tv_sec: 1,
            tv_nsec: 0,
        });
        let fd = stream.as_fd();
        let mut fds = [rustix::event::PollFd::new(&fd, flags)];
        match rustix::event::poll(&mut fds, Some(&timeout)) {
            Ok(0) | Err(rustix::io::Errno::INTR) => continue,
            Ok(_) => return true,
            // Not a descriptor poll can wait on: the read or write that follows fails.
            Err(_) => return true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (StdStream, StdStream) {
        let (a, b) = StdStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        (a, b)
    }

    fn done(o: OnThread) -> Result<Asked, ClientError> {
        match o {
            OnThread::Done(r) => r,
            OnThread::Waiting(_) => panic!("still waiting"),
        }
    }

    /// An answer written in pieces is read whole on the caller's thread; a request reaches
    /// the other end as its frame.
    #[test]
    fn an_answer_in_pieces_is_read_whole_on_the_thread() {
        let (mut line, mut broker) = pair();
        let served = std::thread::spawn(move || {
            let mut req = [0u8; LINE_FRAME_HEAD + 3];
            broker.read_exact(&mut req).unwrap();
            let answer = line_frame(LINE_GRANTED, b"abcdef");
            broker.write_all(&answer[..2]).unwrap();
            std::thread::sleep(Duration::from_millis(2));
            broker.write_all(&answer[2..]).unwrap();
            req
        });
        let asked = done(on_thread(&mut line, 0x01, b"xyz", THREAD_WAIT)).unwrap();
        assert!(matches!(asked, Asked::Answered(LINE_GRANTED, ref b) if b == b"abcdef"));
        assert_eq!(served.join().unwrap().to_vec(), line_frame(0x01, b"xyz"));
    }

    /// An answer slower than the thread's wait is awaited on the runtime, what came of it
    /// on the thread kept.
    #[tokio::test]
    async fn a_slow_answer_is_awaited_on_the_runtime() {
        let (mut line, mut broker) = pair();
        let (waiting, rest) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            let mut req = [0u8; LINE_FRAME_HEAD];
            broker.read_exact(&mut req).unwrap();
            let answer = line_frame(LINE_RELEASED, b"late");
            broker.write_all(&answer[..3]).unwrap();
            // The rest only once the caller stopped waiting on its thread.
            rest.recv().unwrap();
            broker.write_all(&answer[3..]).unwrap();
        });
        // A short wait: the rest comes only after it.
        let wait = Duration::from_millis(50);
        let OnThread::Waiting(part) = on_thread(&mut line, 0x02, b"", wait) else {
            panic!("answered within the wait")
        };
        waiting.send(()).unwrap();
        let mut line = UnixStream::from_std(line).unwrap();
        let asked = awaited(&mut line, part).await.unwrap();
        assert!(matches!(asked, Asked::Answered(LINE_RELEASED, ref b) if b == b"late"));
        t.join().unwrap();
    }

    /// A line closed with nothing sent back is a request not served; one closed after a
    /// part of an answer, or answered with what is not an answer, is an error.
    #[test]
    fn a_close_before_an_answer_is_not_served_and_a_part_of_one_is_an_error() {
        for (sent, served) in [
            (Vec::new(), true),
            (vec![LINE_GRANTED, 9], false),
            (line_frame(0x7f, b""), false),
            ([line_frame(LINE_NOT_HERE, b""), vec![1]].concat(), false),
        ] {
            let (mut line, mut broker) = pair();
            let expected = sent.clone();
            let t = std::thread::spawn(move || {
                let mut req = [0u8; LINE_FRAME_HEAD];
                broker.read_exact(&mut req).unwrap();
                broker.write_all(&expected).unwrap();
            });
            let asked = done(on_thread(&mut line, 0x01, b"", THREAD_WAIT));
            t.join().unwrap();
            match served {
                true => assert!(matches!(asked, Ok(Asked::NotSent))),
                false => assert!(
                    matches!(asked, Err(ClientError::Protocol(_))),
                    "{sent:?} taken as an answer"
                ),
            }
        }
    }

    /// The runtime's wire judges answers alike.
    #[tokio::test]
    async fn the_runtime_wire_reads_the_same_answers() {
        let (line, mut broker) = pair();
        let mut line = UnixStream::from_std(line).unwrap();
        let t = std::thread::spawn(move || {
            let mut req = [0u8; LINE_FRAME_HEAD];
            broker.read_exact(&mut req).unwrap();
            broker.write_all(&line_frame(LINE_RELEASED, b"r")).unwrap();
            broker.read_exact(&mut req).unwrap();
            broker.write_all(&[LINE_GRANTED, 9, 0]).unwrap();
        });
        let asked = on_runtime(&mut line, 0x02, b"").await.unwrap();
        assert!(matches!(asked, Asked::Answered(LINE_RELEASED, ref b) if b == b"r"));
        let broke = on_runtime(&mut line, 0x01, b"").await;
        assert!(matches!(broke, Err(ClientError::Protocol(_))));
        t.join().unwrap();
    }
}
