//! unidiff alone, for its share of a binary.
use std::io::Read;
fn main() {
    let mut s = String::new();
    let _ = std::io::stdin().read_to_string(&mut s);
    let mut set = unidiff::PatchSet::new();
    println!("{}", set.parse(&s).map_or(0, |()| set.len()));
}
