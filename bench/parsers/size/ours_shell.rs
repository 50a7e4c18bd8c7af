//! Our shell reader alone, for its share of a binary.
use std::io::Read;
fn main() {
    let mut s = String::new();
    let _ = std::io::stdin().read_to_string(&mut s);
    println!("{}", taskbox_policy::shell::parse(&s).commands.len());
}
