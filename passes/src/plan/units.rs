//! Byte sizes as people write them (`4GiB`, `512MiB`, `1.5GB`) and print them.

/// The largest size accepted (1e18 bytes, 888 PiB): far above any device, and far enough below
/// 2^64 that sums of such sizes do not overflow.
pub const MAX_SIZE: usize = 1_000_000_000_000_000_000;

/// Parses a size: a number and an optional unit: B, KB/MB/GB/TB (powers of 1000) or
/// KiB/MiB/GiB/TiB (powers of 1024); case does not matter, a space may separate them.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    // the unit is the trailing letters; what precedes them is the number (`1e3GiB` included)
    let split = t.trim_end_matches(|c: char| c.is_ascii_alphabetic()).len();
    let (num, unit) = (t[..split].trim(), t[split..].trim());
    let bad = || format!("invalid size `{s}`: expected a number with a unit, such as 512MiB, 4GiB or 1.5GB");
    let v: f64 = num.parse().map_err(|_| bad())?;
    if !v.is_finite() {
        return Err(bad());
    }
    let mul: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "kib" | "k" => 1024.0,
        "mib" | "m" => 1024.0 * 1024.0,
        "gib" | "g" => 1024.0 * 1024.0 * 1024.0,
        "tib" | "t" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => return Err(bad()),
    };
    let b = v * mul;
    if b < 1.0 {
        return Err(format!("invalid size `{s}`: must be at least 1 byte"));
    }
    if b > MAX_SIZE as f64 {
        return Err(format!("invalid size `{s}`: {b:e} bytes, over the limit of {MAX_SIZE:e} (no device has that much memory)"));
    }
    Ok(b.round() as usize)
}

/// GPUs by name and their memory as their makers state it (GB: 10^9 bytes), for `--memory h100`.
pub const DEVICE_MEMORY: [(&str, usize); 9] = [
    ("h100", 80_000_000_000),
    ("h200", 141_000_000_000),
    ("a100", 80_000_000_000),
    ("a100-40gb", 40_000_000_000),
    ("l4", 24_000_000_000),
    ("a10", 24_000_000_000),
    ("rtx4090", 24_000_000_000),
    ("rtx3090", 24_000_000_000),
    ("t4", 16_000_000_000),
];

/// A memory size (`--memory`): a GPU's name from [`DEVICE_MEMORY`] (any case), or a size as
/// [`parse_size`] reads it.
pub fn parse_memory(s: &str) -> Result<usize, String> {
    let t = s.trim().to_ascii_lowercase();
    if let Some((_, b)) = DEVICE_MEMORY.iter().find(|(n, _)| *n == t) {
        return Ok(*b);
    }
    if t.starts_with(|c: char| c.is_ascii_alphabetic()) {
        let names: Vec<&str> = DEVICE_MEMORY.iter().map(|(n, _)| *n).collect();
        return Err(format!("unknown device `{s}`: give a size such as 24GiB, or one of {}", names.join(", ")));
    }
    parse_size(s)
}

/// `1.50 GiB`, `12.00 MiB`, `512 B`.
pub fn human(b: usize) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", units[u])
    }
}

/// A size as a flag value that parses back (`2.31GiB`), rounded up so it still fits.
pub fn flag(b: usize) -> String {
    let gib = 1024.0 * 1024.0 * 1024.0;
    let mib = 1024.0 * 1024.0;
    // exact where that is short (what the user wrote reads back as written), rounded up otherwise
    if b > 0 && b.is_multiple_of(1 << 30) {
        return format!("{}GiB", b >> 30);
    }
    if b > 0 && b.is_multiple_of(1 << 20) {
        return format!("{}MiB", b >> 20);
    }
    if b < 1 << 20 {
        return format!("{b}B");
    }
    if b as f64 >= gib {
        format!("{:.2}GiB", (b as f64 / gib * 100.0).ceil() / 100.0)
    } else {
        format!("{:.1}MiB", (b as f64 / mib * 10.0).ceil() / 10.0)
    }
}

/// FLOPs as `1.23 GFLOP`.
pub fn flops(f: u64) -> String {
    let (v, u) = match f {
        f if f >= 1_000_000_000_000 => (f as f64 / 1e12, "TFLOP"),
        f if f >= 1_000_000_000 => (f as f64 / 1e9, "GFLOP"),
        f if f >= 1_000_000 => (f as f64 / 1e6, "MFLOP"),
        f if f >= 1_000 => (f as f64 / 1e3, "kFLOP"),
        f => return format!("{f} FLOP"),
    };
    format!("{v:.2} {u}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_in_both_unit_families() {
        assert_eq!(parse_size("4GiB"), Ok(4 << 30));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("1.5GB"), Ok(1_500_000_000));
        assert_eq!(parse_size("10 mib"), Ok(10 << 20));
        assert_eq!(parse_size("1000"), Ok(1000));
        assert!(parse_size("4GX").unwrap_err().contains("512MiB"));
        assert!(parse_size("").is_err());
        assert!(parse_size("0GiB").is_err());
        assert!(parse_size("-1GiB").is_err());
        assert_eq!(parse_size("1e3KB"), Ok(1_000_000));
        assert!(parse_size("1e30GiB").unwrap_err().contains("over the limit"), "{:?}", parse_size("1e30GiB"));
        assert!(parse_size("nanGiB").unwrap_err().contains("512MiB"));
        assert!(parse_size("infGiB").unwrap_err().contains("512MiB"));
        assert_eq!(parse_size(&flag(3_000_000_000)).map(|b| b >= 3_000_000_000), Ok(true));
        assert_eq!(parse_memory("H100"), Ok(80_000_000_000));
        assert_eq!(parse_memory("24GiB"), Ok(24 << 30));
        assert!(parse_memory("h900").unwrap_err().contains("h100"));
    }
}
