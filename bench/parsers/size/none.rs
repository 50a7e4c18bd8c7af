//! The baseline: a binary that reads its input and parses nothing.
use std::io::Read;
fn main() {
    let mut s = String::new();
    let _ = std::io::stdin().read_to_string(&mut s);
    println!("{}", s.len());
}
