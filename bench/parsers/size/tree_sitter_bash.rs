//! tree-sitter with the bash grammar alone, for its share of a binary.
use std::io::Read;
fn main() {
    let mut s = String::new();
    let _ = std::io::stdin().read_to_string(&mut s);
    let mut p = tree_sitter::Parser::new();
    if p.set_language(&tree_sitter_bash::LANGUAGE.into()).is_err() {
        std::process::exit(1);
    }
    let n = p
        .parse(&s, None)
        .map_or(0, |t| t.root_node().descendant_count());
    println!("{n}");
}
