//! Lists over many records: the keyset and scan budget hold at scale. Page
//! response times at 1,000,000 records are scenario E of the engine
//! benchmark (`cargo bench --bench engine -- --only E`).

use ballast::store::Backend;

use crate::helpers::TestDb;
use crate::seed::seed;

/// Lists whose filters share no index search a bounded id range per call:
/// a filter matching nothing returns short pages with a cursor instead of
/// walking a whole index, and following the cursors finds every match once.
async fn sparse_filters_page_through(backend: Backend) {
    use ballast::domain::RecordState;
    use ballast::store::{LIST_SCAN_IDS, RecordFilter};
    let Some(t) = TestDb::migrated(backend, "sparse").await else {
        return;
    };
    let n = 150_000;
    seed(&t.url, backend, n).await.unwrap();
    let nothing = RecordFilter {
        state: Some(RecordState::Succeeded),
        error_code: Some("http_5xx".into()),
        limit: 50,
        ..Default::default()
    };
    // Each call stops at the budget with a cursor, the last with none.
    let mut cursor = None;
    let mut calls = 0;
    loop {
        let page =
            t.db.list_records(&RecordFilter {
                before: cursor,
                ..nothing.clone()
            })
            .await
            .unwrap();
        assert!(page.items.is_empty());
        calls += 1;
        match page.next {
            Some(next) => {
                assert_eq!(next, n + 1 - calls * LIST_SCAN_IDS, "stopped at the budget");
                cursor = Some(next);
            }
            None => break,
        }
    }
    assert_eq!(
        calls,
        (n + LIST_SCAN_IDS - 1) / LIST_SCAN_IDS,
        "the rest, then the end"
    );
    // A cursor is the caller's: at either end of i64 it searches what is
    // below it within the budget, and never overflows.
    for (before, next) in [
        (i64::MIN, None),
        (0, None),
        (i64::MAX, Some(i64::MAX - LIST_SCAN_IDS)),
    ] {
        let filter = RecordFilter {
            before: Some(before),
            state: Some(RecordState::Parked),
            provider: Some("prov1".into()),
            limit: 1,
            ..Default::default()
        };
        let page = t.db.list_records(&filter).await.unwrap();
        assert!(page.items.is_empty(), "before {before}");
        assert_eq!(page.next, next, "before {before}");
    }

    let sparse = RecordFilter {
        state: Some(RecordState::Parked),
        provider: Some("prov1".into()),
        limit: 500,
        ..Default::default()
    };
    let seen: Vec<i64> = crate::helpers::listed(&t.db, &sparse)
        .await
        .iter()
        .map(|r| r.id)
        .collect();
    // Parked is n % 10 == 5 and prov1 is n % 4 == 1: one id in twenty.
    assert_eq!(seen.len() as i64, n / 20);
    assert!(
        seen.windows(2).all(|w| w[0] > w[1]),
        "newest first, each once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sparse_filters_page_through_sqlite() {
    sparse_filters_page_through(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sparse_filters_page_through_postgres() {
    sparse_filters_page_through(Backend::Postgres).await;
}
