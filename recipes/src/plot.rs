//! `curves.png`: held-out metrics, and each agent's training reward and loss, over
//! training steps (plotters).
//!
//! Text needs a font; plotters' pure-Rust `ab_glyph` backend is given the first system
//! TrueType font found. Without one the plot is skipped with a message: it is a
//! convenience, the numbers are in `metrics.jsonl` and `summary.json`.

use std::path::Path;
use std::sync::OnceLock;

use plotters::prelude::*;

/// Ten colours told apart at a glance (Tableau 10), so a panel of up to ten curves never
/// draws two in the same colour.
const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

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

/// Named series of `(step, value)` points.
pub type Series<'a> = [(&'a str, &'a [(usize, f64)])];

/// A run's plot: the held-out curves on top, then each agent's training reward and its
/// loss per datum, on axes fitted to them. `Ok(false)` when no font is available.
pub fn run_curves(
    path: &Path,
    title: &str,
    held_out: &Series,
    training: &[(String, Vec<(usize, f64)>)],
) -> anyhow::Result<bool> {
    if !font_ready() {
        eprintln!("no TrueType font found; skipping {}", path.display());
        return Ok(false);
    }
    let pick = |suffix: &str| -> Vec<(&str, &[(usize, f64)])> {
        training
            .iter()
            .filter(|(n, _)| n.ends_with(suffix))
            .map(|(n, p)| (n.as_str(), p.as_slice()))
            .collect()
    };
    let root = BitMapBackend::new(path, (800, 1100)).into_drawing_area();
    root.fill(&WHITE)?;
    let areas = root.split_evenly((3, 1));
    panel(&areas[0], title, "held-out", held_out, Some((0.0, 1.0)))?;
    panel(
        &areas[1],
        "training reward per agent",
        "mean reward",
        &pick(" reward"),
        None,
    )?;
    panel(
        &areas[2],
        "training loss per agent",
        "loss per datum",
        &pick(" loss"),
        None,
    )?;
    root.present()?;
    Ok(true)
}

/// Draws `series` into `area`; `y` fixes the axis, `None` fits it to the points.
fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    y_label: &str,
    series: &Series,
    y: Option<(f64, f64)>,
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let points = || series.iter().flat_map(|(_, pts)| pts.iter());
    let max_x = points().map(|p| p.0).max().unwrap_or(1).max(1);
    let (lo, hi) = y.unwrap_or_else(|| {
        let finite = || points().map(|p| p.1).filter(|v| v.is_finite());
        let lo = finite().fold(f64::INFINITY, f64::min);
        let hi = finite().fold(f64::NEG_INFINITY, f64::max);
        if lo.is_finite() && hi > lo {
            let pad = (hi - lo) * 0.05;
            (lo - pad, hi + pad)
        } else if lo.is_finite() {
            (lo - 1.0, lo + 1.0)
        } else {
            (0.0, 1.0)
        }
    });
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 24))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0usize..max_x, lo..hi)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc(y_label)
        .draw()?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let pts: Vec<(usize, f64)> = pts.iter().copied().filter(|p| p.1.is_finite()).collect();
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))?
            .label(*name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
    }
    if !series.is_empty() {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_a_png_when_a_font_exists() {
        let path = std::env::temp_dir().join(format!("lathe-curves-{}.png", std::process::id()));
        let pts = [(0, 0.1), (4, 0.5), (8, 0.7)];
        let training = vec![
            ("A reward".to_string(), vec![(1, 0.5), (2, 1.5)]),
            ("A loss".to_string(), vec![(1, 2.0), (2, f64::NAN)]),
        ];
        let held_out = [("A", &pts[..]), ("B", &pts[..2])];
        if run_curves(&path, "run", &held_out, &training).unwrap() {
            assert_eq!(&std::fs::read(&path).unwrap()[1..4], b"PNG");
            std::fs::remove_file(path).unwrap();
        }
    }
}
