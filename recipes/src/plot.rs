//! `curves.png`: held-out accuracy per agent over training steps (plotters).
//!
//! Text needs a font; plotters' pure-Rust `ab_glyph` backend is given the first system
//! TrueType font found. Without one the plot is skipped with a message: it is a
//! convenience, the numbers are in `metrics.jsonl` and `summary.json`.

use std::path::Path;
use std::sync::OnceLock;

use plotters::prelude::*;

const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
];

/// Registers a system font as `sans-serif` once; false when none is available.
fn font_ready() -> bool {
    static READY: OnceLock<bool> = OnceLock::new();
    *READY.get_or_init(|| {
        FONT_PATHS.iter().any(|p| {
            std::fs::read(p).is_ok_and(|bytes| {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok()
            })
        })
    })
}

/// Draws one line per named series of `(step, value)` points into `path`. Returns
/// `Ok(false)` when no font is available and nothing was drawn.
pub fn curves(
    path: &Path,
    title: &str,
    y_label: &str,
    series: &[(&str, &[(usize, f64)])],
) -> anyhow::Result<bool> {
    if !font_ready() {
        eprintln!("no TrueType font found; skipping {}", path.display());
        return Ok(false);
    }
    let max_x = series
        .iter()
        .flat_map(|(_, pts)| pts.iter().map(|p| p.0))
        .max()
        .unwrap_or(1)
        .max(1);
    let root = BitMapBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 24))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0usize..max_x, 0f64..1.0f64)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc(y_label)
        .draw()?;
    let colors = [BLUE, RED, GREEN, MAGENTA, CYAN];
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = colors[i % colors.len()];
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))?
            .label(*name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_a_png_when_a_font_exists() {
        let path = std::env::temp_dir().join(format!("lathe-curves-{}.png", std::process::id()));
        let pts = [(0, 0.1), (4, 0.5), (8, 0.7)];
        let drawn = curves(&path, "test", "accuracy", &[("A", &pts), ("B", &pts[..2])]).unwrap();
        if drawn {
            let bytes = std::fs::read(&path).unwrap();
            assert_eq!(&bytes[1..4], b"PNG");
            std::fs::remove_file(path).unwrap();
        }
    }
}
