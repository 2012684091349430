//! Waiting for what another task, process or the database does: on the
//! event itself where there is one (a child's line of output, its exit),
//! and by re-checking a condition where there is none. Every wait has a
//! limit, a generous safety bound so that a broken build fails instead of
//! hanging; no limit is an assertion on how long something took.

use std::fmt::Debug;
use std::time::Duration;

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
