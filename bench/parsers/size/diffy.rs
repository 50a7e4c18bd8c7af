//! diffy's patch-set parser alone, for its share of a binary.
use std::io::Read;
fn main() {
    let mut s = String::new();
    let _ = std::io::stdin().read_to_string(&mut s);
    let opts = diffy::patch_set::ParseOptions::gitdiff();
    let n = diffy::patch_set::PatchSet::parse(&s, opts)
        .filter(Result::is_ok)
        .count();
    println!("{n}");
}
