//! Waiting for what another task, process or the database does: on the
//! event itself where there is one (a child's line of output, its exit),
//! and by re-checking a condition where there is none. Every wait has a
//! limit, a generous safety bound so that a broken build fails instead of
//! hanging; no limit is an assertion on how long something took.

use std::fmt::Debug;
use std::io::BufRead;
use std::process::{Child, ExitStatus};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

/// The longest pause between two checks of a condition.
const MAX_PAUSE: Duration = Duration::from_millis(200);

/// Re-checks `check` until it returns `Ok`, and returns what it holds; an
/// `Err` carries what was observed instead. After `limit` it panics with
/// `what` and the last observation.
///
/// Polling is used because the state waited on lives where nothing
/// announces its changes: in the database (written by the server's own
/// tasks), in the simulator, in a browser's page, or behind an HTTP
/// endpoint. The pause between checks starts short and doubles up to
/// [`MAX_PAUSE`], so a quick change is seen quickly and a slow one costs
/// the two shared cores little.
pub async fn until<T, O: Debug>(
    what: &str,
    limit: Duration,
    mut check: impl AsyncFnMut() -> Result<T, O>,
) -> T {
    let deadline = Instant::now() + limit;
    let mut pause = Duration::from_millis(5);
    loop {
        match check().await {
            Ok(done) => return done,
            Err(seen) if Instant::now() >= deadline => {
                panic!("{what}: still not so after {limit:?}; last seen: {seen:?}")
            }
            Err(_) => {}
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(MAX_PAUSE);
    }
}

/// The lines a child process writes to a pipe, as they come. A thread
/// reads the pipe to its end (so the child never blocks on a full pipe)
/// and hands each line over; the test awaits them.
pub struct Lines {
    rx: mpsc::UnboundedReceiver<String>,
    /// Every line handed over so far, each ending in a newline.
    seen: String,
}

impl Lines {
    pub fn read(pipe: impl std::io::Read + Send + 'static) -> Lines {
        let (tx, rx) = mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(pipe).lines().map_while(Result::ok) {
                // Keep reading when nobody listens any more: the child must
                // not block on its output.
                let _ = tx.send(line);
            }
        });
        Lines {
            rx,
            seen: String::new(),
        }
    }

    /// Waits for the first line for which `want` holds and returns it.
    /// Panics with everything read so far when the pipe closes first (the
    /// child exited) or after `limit`.
    pub async fn until(
        &mut self,
        what: &str,
        limit: Duration,
        want: impl Fn(&str) -> bool,
    ) -> String {
        let deadline = Instant::now() + limit;
        loop {
            match self.next_line(deadline).await {
                Ok(Some(line)) => {
                    if want(&line) {
                        return line;
                    }
                }
                Ok(None) => panic!("{what}: the output ended first:\n{}", self.seen),
                Err(_) => panic!(
                    "{what}: not within {limit:?}; output so far:\n{}",
                    self.seen
                ),
            }
        }
    }

    /// The next line, kept in [`seen`](Self::seen); `None` once the pipe
    /// has closed; `Err` at `deadline`.
    async fn next_line(
        &mut self,
        deadline: Instant,
    ) -> Result<Option<String>, tokio::time::error::Elapsed> {
        let line = tokio::time::timeout_at(deadline, self.rx.recv()).await?;
        if let Some(l) = &line {
            self.seen.push_str(l);
            self.seen.push('\n');
        }
        Ok(line)
    }

    /// Every line read so far.
    pub fn seen(&self) -> &str {
        &self.seen
    }

    /// Everything the child wrote, once the pipe has closed (the child
    /// exited), waiting at most `limit` for that.
    pub async fn all(mut self, limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        loop {
            match self.next_line(deadline).await {
                Ok(Some(_)) => {}
                Ok(None) => return self.seen,
                Err(_) => panic!("the output did not end within {limit:?}:\n{}", self.seen),
            }
        }
    }
}

/// Waits for `child` to exit and returns how it did. After `limit` the
/// child is killed and the test fails with `what`.
pub async fn exit(mut child: Child, what: &str, limit: Duration) -> ExitStatus {
    let pid = child.id();
    let (tx, rx) = oneshot::channel();
    // `Child::wait` blocks until the exit: a thread waits so the test can
    // await the exit as an event.
    std::thread::spawn(move || {
        let _ = tx.send(child.wait());
    });
    match tokio::time::timeout(limit, rx).await {
        Ok(Ok(status)) => status.expect("waiting on the child"),
        Ok(Err(_)) => panic!("{what}: the waiting thread ended without a status"),
        Err(_) => {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
            panic!("{what}: did not exit within {limit:?}")
        }
    }
}

#[cfg(test)]
mod tests {
    use std::process::{Command, Stdio};
    use std::time::Duration;

    use super::{Lines, exit, until};

    fn sh(script: &str) -> std::process::Child {
        Command::new("sh")
            .args(["-c", script])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap()
    }

    #[tokio::test]
    async fn until_returns_once_the_condition_holds() {
        let mut checks = 0;
        let got = until("the third check", Duration::from_secs(10), async || {
            checks += 1;
            if checks == 3 { Ok("done") } else { Err(checks) }
        })
        .await;
        assert_eq!((got, checks), ("done", 3));
    }

    #[tokio::test]
    async fn lines_come_as_they_are_written() {
        let mut child = sh("echo one; echo ready; echo two");
        let mut lines = Lines::read(child.stdout.take().unwrap());
        let ready = lines
            .until("ready", Duration::from_secs(10), |l| l == "ready")
            .await;
        assert_eq!(ready, "ready");
        assert_eq!(lines.seen(), "one\nready\n");
        assert!(exit(child, "sh", Duration::from_secs(10)).await.success());
        assert_eq!(
            lines.all(Duration::from_secs(10)).await,
            "one\nready\ntwo\n"
        );
    }

    #[tokio::test]
    #[should_panic(expected = "ready: the output ended first:\nnot yet\n")]
    async fn a_line_that_never_comes_fails_when_the_output_ends() {
        let mut child = sh("echo 'not yet'");
        let mut lines = Lines::read(child.stdout.take().unwrap());
        exit(child, "sh", Duration::from_secs(10)).await;
        lines
            .until("ready", Duration::from_secs(10), |l| l == "ready")
            .await;
    }
}
