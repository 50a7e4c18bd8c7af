#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| taskbox_fuzz::chunked_body(data));
