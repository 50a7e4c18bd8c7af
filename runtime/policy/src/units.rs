//! Sizes and durations as policy files write them (`"512MiB"`, `"1.5 GiB"`, `"30s"`), read and
//! written back.

use std::fmt;
use std::time::Duration;

use serde::Serializer;
use serde::de::{self, Deserializer, Visitor};

pub(crate) const KIB: u64 = 1 << 10;
pub(crate) const MIB: u64 = 1 << 20;
pub(crate) const GIB: u64 = 1 << 30;
pub(crate) const TIB: u64 = 1 << 40;

/// Parses a size: an integer number of bytes, or a number with a unit (see the module doc).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let invalid =
        || format!("invalid size {text:?}: expected bytes or a number with a unit like 512MiB");
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let multiplier: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => KIB,
        "m" | "mib" => MIB,
        "g" | "gib" => GIB,
        "t" | "tib" => TIB,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(invalid()),
    };
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() || (number.contains('.') && fraction.is_empty()) {
        return Err(invalid());
    }
    if !fraction.is_empty() && multiplier == 1 {
        return Err(format!(
            "invalid size {text:?}: bytes must be a whole number"
        ));
    }
    let too_large = || format!("invalid size {text:?}: too large");
    let whole: u128 = whole.parse().map_err(|_| too_large())?;
    let mut bytes = whole
        .checked_mul(u128::from(multiplier))
        .ok_or_else(too_large)?;
    if !fraction.is_empty() {
        // Keep at most 12 fractional digits: finer than a byte at every unit up to TiB.
        let digits = &fraction[..fraction.len().min(12)];
        let numerator: u128 = digits.parse().map_err(|_| invalid())?;
        let denominator = 10u128.pow(u32::try_from(digits.len()).unwrap_or(12));
        bytes += numerator * u128::from(multiplier) / denominator;
    }
    u64::try_from(bytes).map_err(|_| too_large())
}

/// Formats a size for people: `4 GiB`, `1.5 MiB`, `512 bytes`.
pub fn human_size(bytes: u64) -> String {
    for (unit, size) in [("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)] {
        if bytes >= size {
            if bytes.checked_rem(size) == Some(0) {
                return format!("{} {unit}", bytes / size);
            }
            // Display only; u64 to f64 loses nothing that one decimal shows.
            #[allow(clippy::cast_precision_loss)]
            let value = bytes as f64 / size as f64;
            return format!("{value:.1} {unit}");
        }
    }
    if bytes == 1 {
        "1 byte".to_owned()
    } else {
        format!("{bytes} bytes")
    }
}

/// The exact, re-parseable spelling of a size: the largest IEC unit that divides it, else bytes.
fn size_string(bytes: u64) -> String {
    for (unit, size) in [("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)] {
        if bytes != 0 && bytes.checked_rem(size) == Some(0) {
            return format!("{}{unit}", bytes / size);
        }
    }
    format!("{bytes}B")
}

pub(crate) fn ser_size<S: Serializer>(bytes: &u64, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&size_string(*bytes))
}

pub(crate) fn de_size<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    struct SizeVisitor;
    impl Visitor<'_> for SizeVisitor {
        type Value = u64;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a size: bytes or a number with a unit like 512MiB")
        }
        fn visit_u64<E: de::Error>(self, value: u64) -> Result<u64, E> {
            Ok(value)
        }
        fn visit_i64<E: de::Error>(self, value: i64) -> Result<u64, E> {
            u64::try_from(value)
                .map_err(|_| E::custom(format!("invalid size {value}: must not be negative")))
        }
        fn visit_str<E: de::Error>(self, value: &str) -> Result<u64, E> {
            parse_size(value).map_err(E::custom)
        }
    }
    deserializer.deserialize_any(SizeVisitor)
}

pub(crate) fn ser_duration<S: Serializer>(
    duration: &Duration,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&humantime::format_duration(*duration).to_string())
}

pub(crate) fn de_duration<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Duration, D::Error> {
    struct DurationVisitor;
    impl Visitor<'_> for DurationVisitor {
        type Value = Duration;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a duration string like \"30s\", \"10m\" or \"1h 30m\"")
        }
        fn visit_str<E: de::Error>(self, value: &str) -> Result<Duration, E> {
            humantime::parse_duration(value.trim()).map_err(|_| {
                E::custom(format!(
                    "invalid duration {value:?}: expected a duration like \"30s\", \"10m\" or \"1h 30m\""
                ))
            })
        }
    }
    deserializer.deserialize_any(DurationVisitor)
}
