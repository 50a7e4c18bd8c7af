//! Our patch parser alone, for its share of a binary.
use std::io::Read;
fn main() {
    let mut s = String::new();
    let _ = std::io::stdin().read_to_string(&mut s);
    let n = taskbox_workspace::fsops::patch_parser::parse(&s).map_or(0, |f| f.len());
    println!("{n}");
}
