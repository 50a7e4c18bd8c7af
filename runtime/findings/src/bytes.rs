//! Classes of 64 bytes at a time, as bit masks: where a name ends and where padding does, for
//! the runs of lines a reader takes whole ([`crate::Reader::skim`]). A line of a passed go test
//! is about 30 bytes; finding its name's end byte by byte, or 8 bytes at a time, cost more
//! than the rest of reading it. Every x86-64 has SSE2, which compares 16 bytes at once; other
//! machines classify a byte at a time.

/// Bit `i` stands for the byte `i` places after the start; bytes past the end are zeros.
#[derive(Clone, Copy)]
pub(crate) struct Classes {
    /// The bytes a name does not hold: under 0x21 (controls and the space), 0x7f and over, or
    /// a colon.
    pub stop: u64,
    /// Spaces.
    pub space: u64,
}

/// The classes of the 64 bytes of `bytes` from `at`. Out of line: inlined into a reader's loop,
/// LLVM took masks of this kind apart bit by bit and put them together again (a variant of 32
/// bytes read 1.6 times as slow).
#[inline(never)]
pub(crate) fn classes(bytes: &[u8], at: usize) -> Classes {
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
fn of(block: &[u8; 64]) -> Classes {
    // SAFETY: SSE2 is part of every x86-64 (the target's baseline).
    unsafe { sse2(block) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse2")]
fn sse2(block: &[u8; 64]) -> Classes {
    use std::arch::x86_64::{
        _mm_cmpeq_epi8, _mm_cmplt_epi8, _mm_loadu_si128, _mm_movemask_epi8, _mm_or_si128,
        _mm_set1_epi8,
    };
    let (mut stop, mut space) = (0, 0);
    for (k, sixteen) in block.chunks_exact(16).enumerate() {
        // SAFETY: `sixteen` is 16 readable bytes; `loadu` takes them at any alignment.
        let x = unsafe { _mm_loadu_si128(sixteen.as_ptr().cast()) };
        // A signed compare: 0x80 and over are negative, so under 0x21.
        let odd = _mm_or_si128(
            _mm_cmplt_epi8(x, _mm_set1_epi8(0x21)),
            _mm_cmpeq_epi8(x, _mm_set1_epi8(0x7f)),
        );
        let s = _mm_or_si128(odd, _mm_cmpeq_epi8(x, _mm_set1_epi8(b':' as i8)));
        let sp = _mm_cmpeq_epi8(x, _mm_set1_epi8(b' ' as i8));
        // The mask is 16 bits, one for each byte's high bit.
        stop |= u64::from(_mm_movemask_epi8(s) as u16) << (16 * k);
        space |= u64::from(_mm_movemask_epi8(sp) as u16) << (16 * k);
    }
    Classes { stop, space }
}

#[cfg(not(target_arch = "x86_64"))]
fn of(block: &[u8; 64]) -> Classes {
    bytewise(block)
}

/// [`of`] a byte at a time.
#[cfg(any(test, not(target_arch = "x86_64")))]
fn bytewise(block: &[u8; 64]) -> Classes {
    let (mut stop, mut space) = (0, 0);
    for (i, &b) in block.iter().enumerate() {
        if !(0x21..0x7f).contains(&b) || b == b':' {
            stop |= 1 << i;
        }
        if b == b' ' {
            space |= 1 << i;
        }
    }
    Classes { stop, space }
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
                    let (got, want) = (of(&block), bytewise(&block));
                    assert_eq!(
                        (got.stop, got.space),
                        (want.stop, want.space),
                        "{b:#x} at {at}"
                    );
                }
            }
        }
        let line = b"=== RUN   TestX\n";
        let c = classes(line, 0);
        assert_eq!(c.stop, 1 << 3 | 0b111 << 7 | u64::MAX << 15);
        assert_eq!(c.space, 1 << 3 | 0b111 << 7);
        assert_eq!(classes(line, 10).stop, u64::MAX << 5);
        assert_eq!(classes(line, 99).stop, u64::MAX);
    }
}
