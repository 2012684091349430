//! Rebuild when migrations change: they are embedded with `include_str!`.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
