//! What to say when an error ends a command: its causes on one line, each
//! said once, and for the causes a start-up meets (a busy, unwritable or
//! full SQLite file, a PostgreSQL that cannot be reached or refuses us, a
//! newer schema, an address in use) what to do about it.

use crate::store::StoreError;

/// The line printed after `error: `: [`one_line`], then `; ` and the hint
/// for its first cause that has one (unless the message already says it).
pub fn report(e: &anyhow::Error) -> String {
    let line = one_line(e);
    match hint(e) {
        Some(h) if !line.contains(h) => format!("{line}; {h}"),
        _ => line,
    }
}

/// An error and its causes on one line, each cause said once: a cause
/// whose text its parent's message already holds (sqlx's migration
/// errors repeat their source, say) is left out.
pub fn one_line(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if text.is_empty() || out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

/// What to do about the first cause in `e`'s chain that we know.
pub fn hint(e: &anyhow::Error) -> Option<&'static str> {
    e.chain().find_map(cause_hint)
}

const BUSY: &str = "another process kept the SQLite file's write lock past database.busy_timeout \
     (a backup, an open sqlite3 shell, a node migrating a large file?): let it finish and start again";
const UNWRITABLE: &str = "the SQLite file's directory must exist, and this user must be able to read \
     and write the file and create files beside it (SQLite keeps -wal and -shm files there): check the \
     path in database.url, its owner and its mode";
const FULL: &str = "the disk holding the database is full: free space (a purge, a vacuum, old backups) \
     and start again";
const NOT_A_DATABASE: &str =
    "the file in database.url is not a SQLite database (or is damaged): check the path";
const UNREACHABLE: &str = "nothing answered at the database's address: is PostgreSQL running there, \
     and is the host and port in database.url (or BALLAST_DATABASE_URL) right?";
const NO_CONNECTION: &str = "no connection to the database within database.acquire_timeout: is \
     PostgreSQL running and reachable at the host and port in database.url (or \
     BALLAST_DATABASE_URL), and has it connections to spare? On SQLite: does another process hold \
     the file?";
const REFUSED_LOGIN: &str =
    "PostgreSQL refused the login: check the user and password in database.url (and pg_hba.conf)";
const NO_DATABASE: &str = "that database does not exist on the server: create it (`createdb NAME`) or fix its name in database.url";
const NO_PRIVILEGE: &str = "the database user lacks a privilege it needs: ballast's user must own its \
     schema (it creates and alters tables when it migrates)";
const TOO_MANY: &str = "PostgreSQL has no connection left: lower database.max_connections on the \
     nodes, or raise max_connections on the server";
const STARTING: &str = "PostgreSQL is starting up or shutting down: start again in a moment";
const READ_ONLY: &str = "this PostgreSQL is a read-only standby: point database.url at the primary";
const BAD_URL: &str = "check database.url (or BALLAST_DATABASE_URL): `sqlite://PATH?mode=rwc` or \
     `postgres://USER@HOST:PORT/DATABASE`";
const TLS: &str = "the TLS handshake with PostgreSQL failed: check sslmode and the certificates named \
     in database.url";
const ADDRESS_IN_USE: &str = "another process listens on that address: stop it, or pick another with --bind (or server.bind)";
const ADDRESS_NOT_HERE: &str =
    "that address is not one of this machine's: check --bind (or server.bind)";
const NO_PERMISSION: &str = "permission denied: check the owner and mode of the path named, or the \
     user this runs as (ports below 1024 need privileges)";

fn cause_hint(cause: &(dyn std::error::Error + 'static)) -> Option<&'static str> {
    if let Some(StoreError::Database(e)) = cause.downcast_ref::<StoreError>() {
        return sqlx_hint(e);
    }
    if let Some(e) = cause.downcast_ref::<sqlx::Error>() {
        return sqlx_hint(e);
    }
    cause.downcast_ref::<std::io::Error>().and_then(io_hint)
}

fn sqlx_hint(e: &sqlx::Error) -> Option<&'static str> {
    match e {
        sqlx::Error::Database(d) => {
            let code = d.code()?;
            if d.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
                code.parse().ok().and_then(sqlite_hint)
            } else {
                sqlstate_hint(&code)
            }
        }
        sqlx::Error::Io(e) => io_hint(e),
        sqlx::Error::PoolTimedOut => Some(NO_CONNECTION),
        sqlx::Error::Tls(_) => Some(TLS),
        sqlx::Error::Configuration(_) => Some(BAD_URL),
        _ => None,
    }
}

/// SQLite's result codes: the primary code is the low byte.
fn sqlite_hint(code: i32) -> Option<&'static str> {
    match code & 0xff {
        // SQLITE_BUSY (SQLITE_LOCKED, 6, is a lock inside one process)
        5 => Some(BUSY),
        // SQLITE_READONLY, SQLITE_CANTOPEN, SQLITE_PERM
        8 | 14 | 3 => Some(UNWRITABLE),
        // SQLITE_FULL
        13 => Some(FULL),
        // SQLITE_NOTADB
        26 => Some(NOT_A_DATABASE),
        _ => None,
    }
}

/// PostgreSQL's SQLSTATEs (five characters, often all digits).
fn sqlstate_hint(code: &str) -> Option<&'static str> {
    match code {
        "28P01" | "28000" => Some(REFUSED_LOGIN),
        "3D000" => Some(NO_DATABASE),
        "42501" => Some(NO_PRIVILEGE),
        "53300" => Some(TOO_MANY),
        "57P03" => Some(STARTING),
        "25006" => Some(READ_ONLY),
        _ => None,
    }
}

fn io_hint(e: &std::io::Error) -> Option<&'static str> {
    use std::io::ErrorKind;
    match e.kind() {
        ErrorKind::ConnectionRefused
        | ErrorKind::TimedOut
        | ErrorKind::ConnectionReset
        | ErrorKind::HostUnreachable
        | ErrorKind::NetworkUnreachable => Some(UNREACHABLE),
        ErrorKind::ReadOnlyFilesystem => Some(UNWRITABLE),
        ErrorKind::AddrInUse => Some(ADDRESS_IN_USE),
        ErrorKind::AddrNotAvailable => Some(ADDRESS_NOT_HERE),
        ErrorKind::PermissionDenied => Some(NO_PERMISSION),
        ErrorKind::StorageFull => Some(FULL),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cause_already_said_is_not_said_again() {
        // sqlx's migration error repeats its source in its own text.
        let db = std::io::Error::other("(code: 1) table meta already exists");
        let migrate = sqlx::migrate::MigrateError::ExecuteMigration(sqlx::Error::Io(db), 1);
        let e = anyhow::Error::new(migrate).context("cannot migrate the database");
        let line = one_line(&e);
        assert_eq!(
            line.matches("table meta already exists").count(),
            1,
            "{line}"
        );
        assert!(line.starts_with("cannot migrate the database: "), "{line}");
        let plain = anyhow::anyhow!("inner").context("outer");
        assert_eq!(one_line(&plain), "outer: inner");
    }

    #[test]
    fn codes_map_to_hints() {
        assert_eq!(sqlite_hint(5), Some(BUSY));
        assert_eq!(sqlite_hint(517), Some(BUSY), "SQLITE_BUSY_SNAPSHOT");
        assert_eq!(
            sqlite_hint(1032),
            Some(UNWRITABLE),
            "SQLITE_READONLY_DBMOVED"
        );
        assert_eq!(sqlite_hint(14), Some(UNWRITABLE));
        assert_eq!(sqlite_hint(1), None);
        assert_eq!(sqlstate_hint("3D000"), Some(NO_DATABASE));
        assert_eq!(
            sqlstate_hint("28000"),
            Some(REFUSED_LOGIN),
            "all digits, still a SQLSTATE"
        );
        assert_eq!(
            sqlstate_hint("23505"),
            None,
            "a unique violation is no start-up matter"
        );
    }

    #[test]
    fn an_io_cause_deep_in_the_chain_is_found() {
        let io = std::io::Error::from(std::io::ErrorKind::AddrInUse);
        let e = anyhow::Error::new(io).context("cannot listen on 127.0.0.1:80");
        assert_eq!(
            report(&e),
            format!(
                "cannot listen on 127.0.0.1:80: {}; {ADDRESS_IN_USE}",
                std::io::Error::from(std::io::ErrorKind::AddrInUse)
            )
        );
    }
}
