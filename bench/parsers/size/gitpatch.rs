//! gitpatch alone, for its share of a binary.
use std::io::Read;
fn main() {
    let mut s = String::new();
    let _ = std::io::stdin().read_to_string(&mut s);
    println!(
        "{}",
        gitpatch::Patch::from_multiple(&s).map_or(0, |p| p.len())
    );
}
