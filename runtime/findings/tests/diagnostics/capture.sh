#!/bin/sh
# Regenerates this directory's samples by running the real tools on tiny projects with planted
# errors (see the projects below). Needs cargo, gcc, clang, and a venv with mypy and ruff
# ($VENV) and a directory with typescript, eslint and @eslint/js installed ($NPM).
# Absolute paths of the scratch projects are rewritten to /workspace/<project> in the samples.
set -u
OUT=$(cd "$(dirname "$0")" && pwd)
SCRATCH=${SCRATCH:-/var/tmp/diag}
VENV=${VENV:-/var/tmp/diag-venv}
NPM=${NPM:-/var/tmp/diag-npm}
# cap NAME DIR CMD...: runs CMD in DIR, stdout and stderr into NAME.
cap() {
    name=$1 dir=$2
    shift 2
    (cd "$dir" && "$@") >"$OUT/$name" 2>&1
    sed -i "s#$dir#/workspace/$(basename "$dir")#g" "$OUT/$name"
}

# --- rust ---
R=$SCRATCH/rs/demo
rm -rf "$SCRATCH/rs" && mkdir -p "$SCRATCH/rs" && (cd "$SCRATCH/rs" && cargo new --quiet demo)
cat >"$R/src/main.rs" <<'X'
mod util;

fn main() {
    let x: i32 = "a";
    println!("{}", x);
    util::helper();
}
X
cat >"$R/src/util.rs" <<'X'
pub fn helper() {
    undefined_fn();
}

pub fn broken() -> u32 {
    let s = String::new()
    s.len()
}
X
cap rustc-build-errors.txt "$R" cargo build
cap rustc-build-errors-color.txt "$R" cargo build --color=always
cap rustc-build-short.txt "$R" cargo build --message-format=short
cat >"$R/src/main.rs" <<'X'
mod util;

fn main() {
    let unused = 5;
    let other = 6;
    let x = 3;
    println!("{}", x);
    util::helper();
}
X
cat >"$R/src/util.rs" <<'X'
pub fn helper() {
    let v = vec![1, 2, 3];
    if v.len() == 0 {
        println!("empty");
    }
}
X
touch "$R/src/main.rs"
cap rustc-warnings.txt "$R" cargo build
touch "$R/src/main.rs"
cap clippy-warnings.txt "$R" cargo clippy
touch "$R/src/main.rs"
cap clippy-deny.txt "$R" cargo clippy -- -D warnings
cat >>"$R/src/main.rs" <<'X'

#[cfg(test)]
mod tests {
    #[test]
    fn adds() {
        let n: u8 = 300;
        assert_eq!(n, 1);
    }
}
X
cap rustc-test-compile-error.txt "$R" cargo test
printf 'fn main() {\n    let x = 1;\n    println!("{}", x);\n}\n' >"$R/src/main.rs"
printf 'pub fn helper() {}\n' >"$R/src/util.rs"
printf 'mod util;\nfn main() {\n    util::helper();\n}\n' >"$R/src/main.rs"
touch "$R/src/main.rs"
cap rustc-clean.txt "$R" cargo build
touch "$R/src/main.rs"
cap clippy-clean.txt "$R" cargo clippy

# --- C and C++ ---
C=$SCRATCH/c
rm -rf "$C" && mkdir -p "$C/src"
cat >"$C/src/a.c" <<'X'
#include <stdio.h>
#include "util.h"

int main(void) {
    int unused = 3;
    int y = x + 1;
    printf("%d\n", y);
    return helper();
}
X
printf 'int helper(void);\n' >"$C/src/util.h"
printf '#include "missing.h"\nint b(void) { return 0; }\n' >"$C/src/b.c"
printf 'int foo(void);\nint main(void) { return foo(); }\n' >"$C/src/link.c"
cat >"$C/src/t.cpp" <<'X'
#include <string>
int main() {
    std::string s = 5;
    return s.size();
}
X
printf '#include <stdio.h>\nint main(void) {\n    printf("hi\\n");\n    return 0;\n}\n' >"$C/src/ok.c"
cap gcc-errors.txt "$C" gcc -Wall -c src/a.c
cap gcc-fatal.txt "$C" gcc -c src/b.c
cap gcc-link.txt "$C" gcc -o /dev/null src/link.c
cap gcc-cpp.txt "$C" g++ -c src/t.cpp -o /dev/null
cap gcc-werror.txt "$C" gcc -Wall -Werror -c src/a.c -o /dev/null
cap gcc-color.txt "$C" gcc -fdiagnostics-color=always -Wall -c src/a.c -o /dev/null
cap gcc-clean.txt "$C" gcc -Wall -o /dev/null src/ok.c
cat >"$C/src/w.c" <<'X'
#include <stdio.h>
static int compute(int a) {
    int unused = 3;
    return a * 2;
}
int main(void) { printf("%d\n", compute(2)); return 0; }
X
cap gcc-warnings.txt "$C" gcc -Wall -o /dev/null src/w.c
cap clang-warnings.txt "$C" clang -Wall -o /dev/null src/w.c
cap clang-color.txt "$C" clang -fcolor-diagnostics -Wall -c src/a.c -o /dev/null
cap clang-errors.txt "$C" clang -Wall -c src/a.c -o /dev/null
cap clang-link.txt "$C" clang -o /dev/null src/link.c
cap clang-fatal.txt "$C" clang -c src/b.c -o /dev/null

# --- mypy and ruff ---
P=$SCRATCH/py
rm -rf "$P" && mkdir -p "$P/pkg"
: >"$P/pkg/__init__.py"
cat >"$P/pkg/a.py" <<'X'
import os
import sys


def f(x: int) -> int:
    l = 1
    y: int = "a"
    return x + l + y


print(sys.argv)
X
cat >"$P/pkg/c.py" <<'X'
import missing_mod


def h(a: str) -> None:
    a.nope()
X
printf 'import sys\n\nprint(sys.argv)\n' >"$P/pkg/ok.py"
cap mypy-errors.txt "$P" "$VENV/bin/mypy" pkg
cap mypy-columns.txt "$P" "$VENV/bin/mypy" --show-column-numbers pkg
cap mypy-pretty.txt "$P" "$VENV/bin/mypy" --pretty pkg/a.py
cap mypy-clean.txt "$P" "$VENV/bin/mypy" pkg/ok.py
cap ruff-full.txt "$P" "$VENV/bin/ruff" check --no-cache pkg
cap ruff-concise.txt "$P" "$VENV/bin/ruff" check --no-cache --output-format=concise pkg
cap ruff-color.txt "$P" env FORCE_COLOR=1 "$VENV/bin/ruff" check --no-cache pkg
cap ruff-select.txt "$P" "$VENV/bin/ruff" check --no-cache --select E,F,W pkg/a.py
printf 'def BadName():\n    pass\n' >"$P/pkg/n.py"
cap ruff-unfixable-first.txt "$P" "$VENV/bin/ruff" check --no-cache --select N pkg/n.py
rm "$P/pkg/n.py"
cap mypy-color.txt "$P" env MYPY_FORCE_COLOR=1 "$VENV/bin/mypy" --color-output pkg
printf 'def g(:\n    pass\n' >"$P/pkg/b.py"
cap mypy-syntax.txt "$P" "$VENV/bin/mypy" pkg/b.py
cap ruff-syntax.txt "$P" "$VENV/bin/ruff" check --no-cache pkg/b.py
cap ruff-syntax-concise.txt "$P" "$VENV/bin/ruff" check --no-cache --output-format=concise pkg/b.py
cap ruff-clean.txt "$P" "$VENV/bin/ruff" check --no-cache pkg/ok.py

# --- tsc and eslint ---
T=$NPM/ts
rm -rf "$T" && mkdir -p "$T/src"
cat >"$T/tsconfig.json" <<'X'
{ "compilerOptions": { "strict": true, "noEmit": true, "target": "es2020", "module": "commonjs" }, "include": ["src"] }
X
cat >"$T/src/a.ts" <<'X'
import { helper } from "./b";

const x: number = "a";
const y = helper(1, 2);
interface P { name: string; age: number }
const p: P = { name: "n" };
const q: { a: { b: number } } = { a: { b: "s" } };
console.log(x, y, p, q);
X
printf 'export function helper(a: number): number {\n  return a;\n}\n' >"$T/src/b.ts"
cap tsc-errors.txt "$T" "$NPM/node_modules/.bin/tsc" -p .
cap tsc-pretty.txt "$T" "$NPM/node_modules/.bin/tsc" -p . --pretty
printf 'export const z: number = 1;\n' >"$T/src/a.ts"
cap tsc-clean.txt "$T" "$NPM/node_modules/.bin/tsc" -p .
J=$NPM/js
rm -rf "$J" && mkdir -p "$J/src"
cat >"$J/eslint.config.js" <<'X'
const js = require("@eslint/js");
module.exports = [js.configs.recommended, { rules: { semi: ["warn", "always"], "no-console": "warn" } }];
X
printf 'const x = 1;\nlet unused = 2;\nconsole.log(undefinedVar)\n' >"$J/src/a.js"
printf 'function f() {\n  return 1\n}\nf();\n' >"$J/src/b.js"
printf 'function (\n' >"$J/src/c.js"
cap eslint-stylish.txt "$J" "$NPM/node_modules/.bin/eslint" src
cap eslint-color.txt "$J" env FORCE_COLOR=1 "$NPM/node_modules/.bin/eslint" src
rm "$J/src/a.js" "$J/src/c.js"
printf 'function f() {\n  return 1;\n}\nf();\n' >"$J/src/b.js"
cap eslint-clean.txt "$J" "$NPM/node_modules/.bin/eslint" src
