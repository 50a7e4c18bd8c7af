//! The bytes a name does not hold, 64 at a time, as a bit mask: where a name ends, for the runs
//! of lines a reader takes whole ([`crate::Reader::skim`]). A line of a passed go test is about
//! 30 bytes; finding its name's end byte by byte, or 8 bytes at a time, cost more than the rest
//! of reading it. Every x86-64 has SSE2, which compares 16 bytes at once; other machines
//! classify a byte at a time.

/// Bit `i` of the mask is set when the byte `i` places after `at` in `bytes` is not one a name
/// holds: under 0x21 (controls and the space), 0x7f and over, or a colon. Bytes past the end
/// are zeros, so they are set. Inlined: a call a line cost 3% of reading a go log. (Two masks at
/// once, of these bytes and of the spaces, were faster out of line: inlined, LLVM took them
/// apart bit by bit and put them together again.)
#[inline]
pub(crate) fn stops(bytes: &[u8], at: usize) -> u64 {
    let rest = bytes.get(at..).unwrap_or_default();
    match rest.first_chunk::<64>() {
        Some(block) => of(block),
        None => {
            let mut block = [0u8; 64];
            block[..rest.len()].copy_from_slice(rest);
            of(&block)
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[inline]
fn of(block: &[u8; 64]) -> u64 {
    // SAFETY: SSE2 is part of every x86-64 (the target's baseline).
    unsafe { sse2(block) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse2")]
#[inline]
fn sse2(block: &[u8; 64]) -> u64 {
    use std::arch::x86_64::{
        _mm_add_epi8, _mm_cmpeq_epi8, _mm_cmpgt_epi8, _mm_loadu_si128, _mm_movemask_epi8,
        _mm_or_si128, _mm_set1_epi8,
    };
    let mut stop = 0;
    for (k, sixteen) in block.chunks_exact(16).enumerate() {
        // SAFETY: `sixteen` is 16 readable bytes; `loadu` takes them at any alignment.
        let x = unsafe { _mm_loadu_si128(sixteen.as_ptr().cast()) };
        // Moved by 0x5f, 0x21..=0x7e become 0x80..=0xdd, the signed bytes up to -35: every
        // other byte compares greater.
        let odd = _mm_cmpgt_epi8(_mm_add_epi8(x, _mm_set1_epi8(0x5f)), _mm_set1_epi8(-35));
        let s = _mm_or_si128(odd, _mm_cmpeq_epi8(x, _mm_set1_epi8(b':' as i8)));
        // The mask is 16 bits, one for each byte's high bit.
        stop |= u64::from(_mm_movemask_epi8(s) as u16) << (16 * k);
    }
    stop
}

#[cfg(not(target_arch = "x86_64"))]
fn of(block: &[u8; 64]) -> u64 {
    bytewise(block)
}

/// [`of`] a byte at a time.
#[cfg(any(test, not(target_arch = "x86_64")))]
fn bytewise(block: &[u8; 64]) -> u64 {
    let mut stop = 0;
    for (i, &b) in block.iter().enumerate() {
        if !(0x21..0x7f).contains(&b) || b == b':' {
            stop |= 1 << i;
        }
    }
    stop
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every byte value at every place, among bytes of each class, reads as it does a byte
    /// at a time; past the end are zeros.
    #[test]
    fn every_byte_is_classed_as_bytewise() {
        for fill in [b'a', b' ', b':', 0x00, 0xff] {
            for at in 0..64 {
                for b in 0..=255u8 {
                    let mut block = [fill; 64];
                    block[at] = b;
                    assert_eq!(of(&block), bytewise(&block), "{b:#x} at {at}");
                }
            }
        }
        let line = b"=== RUN   TestX\n";
        assert_eq!(stops(line, 0), 1 << 3 | 0b111 << 7 | u64::MAX << 15);
        assert_eq!(stops(line, 10), u64::MAX << 5);
        assert_eq!(stops(line, 99), u64::MAX);
    }
}
