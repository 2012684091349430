//! Embeds the migrations: `migrations/<backend>/NNNN_name.{up,down}.sql`
//! become one list per backend in `$OUT_DIR/migrations.rs`, read by
//! `store::migrate`. A new migration is a new pair of files in each
//! backend's folder; the build stops when the two folders disagree on the
//! versions, or a `.sql` file is misnamed or lacks its other half (other
//! files there are ignored).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

type Found = BTreeMap<i64, (String, String)>;
type BuildResult<T> = Result<T, Box<dyn std::error::Error>>;

/// (version → name, file stem) of each migration in `dir`.
fn migrations(dir: &Path) -> BuildResult<Found> {
    let mut found = Found::new();
    let mut halves: BTreeMap<String, u8> = BTreeMap::new();
    let at = dir.display();
    for entry in std::fs::read_dir(dir)? {
        let file = entry?.file_name();
        let file = file.to_string_lossy();
        if !file.ends_with(".sql") {
            continue;
        }
        let stem = file
            .strip_suffix(".up.sql")
            .or_else(|| file.strip_suffix(".down.sql"))
            .ok_or_else(|| format!("{at}: `{file}` is not NNNN_name.up.sql or .down.sql"))?;
        *halves.entry(stem.to_owned()).or_default() += 1;
        let (version, name) = stem
            .split_once('_')
            .ok_or_else(|| format!("{at}: `{file}` has no NNNN_ prefix"))?;
        let version: i64 = version
            .parse()
            .map_err(|_| format!("{at}: `{file}` has no version number"))?;
        if let Some((_, other)) = found.insert(version, (name.to_owned(), stem.to_owned())) {
            if other != stem {
                return Err(format!("{at}: two migrations numbered {version}").into());
            }
        }
    }
    if let Some((stem, _)) = halves.iter().find(|(_, n)| **n != 2) {
        return Err(format!("{at}: `{stem}` needs both .up.sql and .down.sql").into());
    }
    Ok(found)
}

/// One backend's list as Rust: `const NAME: &[Shipped] = &[…];`.
fn list(out: &mut String, konst: &str, dir: &Path, found: &Found) -> std::fmt::Result {
    writeln!(out, "const {konst}: &[Shipped] = &[")?;
    for (version, (name, stem)) in found {
        let path = |half: &str| dir.join(format!("{stem}.{half}.sql"));
        let (up, down) = (path("up"), path("down"));
        writeln!(
            out,
            "    ({version}, {name:?}, include_str!({up:?}), include_str!({down:?})),"
        )?;
    }
    writeln!(out, "];")
}

fn main() -> BuildResult<()> {
    println!("cargo:rerun-if-changed=migrations");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
    let (sqlite, postgres) = (root.join("sqlite"), root.join("postgres"));
    let (lite, pg) = (migrations(&sqlite)?, migrations(&postgres)?);
    if !lite.keys().eq(pg.keys()) {
        return Err("migrations/sqlite and migrations/postgres ship different versions".into());
    }
    let mut out = String::new();
    list(&mut out, "SQLITE", &sqlite, &lite)?;
    list(&mut out, "POSTGRES", &postgres, &pg)?;
    std::fs::write(
        Path::new(&std::env::var("OUT_DIR")?).join("migrations.rs"),
        out,
    )?;
    Ok(())
}
