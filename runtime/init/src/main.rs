//! `taskbox-init`: the sandbox set-up helper binary (see the library's documentation).

fn main() {
    taskbox_init::run_main()
}
