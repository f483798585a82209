//! A timeline picture: stacked areas of live bytes by tag, our reserved bytes and PyTorch's.

use super::engine::ReplayResult;
use crate::tag::Tag;
use crate::units::in_gib;

const W: f64 = 960.0;
const H: f64 = 420.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 170.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 40.0;

fn color(t: Tag) -> &'static str {
    match t {
        Tag::Weights => "#4c78a8",
        Tag::Activation => "#f58518",
        Tag::KvCache => "#54a24b",
        Tag::Untracked => "#b8b8b8",
    }
}

/// Render the timeline of a replay as an SVG document.
pub fn timeline(r: &ReplayResult, title: &str) -> String {
    let pts = &r.timeline;
    let max_x = pts.last().map_or(1, |p| p.event.max(1)) as f64;
    let max_y = pts
        .iter()
        .map(|p| {
            p.reserved
                .max(p.torch_reserved)
                .max(Tag::ALL.iter().map(|&t| p.live[t]).sum())
        })
        .max()
        .unwrap_or(1)
        .max(1) as f64
        * 1.05;
    let x = |e: usize| LEFT + (e as f64 / max_x) * (W - LEFT - RIGHT);
    let y = |b: u64| H - BOTTOM - (b as f64 / max_y) * (H - TOP - BOTTOM);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{LEFT}\" y=\"22\" font-size=\"15\">{}</text>\n",
        escape(title)
    );
    // Stacked live areas, bottom to top.
    let mut below = vec![0u64; pts.len()];
    for t in Tag::ALL {
        let above: Vec<u64> = pts.iter().zip(&below).map(|(p, b)| b + p.live[t]).collect();
        let mut d = String::new();
        for (p, v) in pts.iter().zip(&above) {
            d.push_str(&format!(
                "{}{:.1},{:.1} ",
                if d.is_empty() { "M" } else { "L" },
                x(p.event),
                y(*v)
            ));
        }
        for (p, v) in pts.iter().zip(&below).rev() {
            d.push_str(&format!("L{:.1},{:.1} ", x(p.event), y(*v)));
        }
        s.push_str(&format!(
            "<path d=\"{d}Z\" fill=\"{}\" fill-opacity=\"0.85\" stroke=\"none\"/>\n",
            color(t)
        ));
        below = above;
    }
    for (label, pick, col, dash) in [
        ("vram-ledger reserved", 0, "#d62728", ""),
        (
            "PyTorch reserved",
            1,
            "#000000",
            " stroke-dasharray=\"6,4\"",
        ),
    ] {
        let mut d = String::new();
        for p in pts {
            let v = if pick == 0 {
                p.reserved
            } else {
                p.torch_reserved
            };
            d.push_str(&format!(
                "{}{:.1},{:.1} ",
                if d.is_empty() { "M" } else { "L" },
                x(p.event),
                y(v)
            ));
        }
        s.push_str(&format!("<path d=\"{d}\" fill=\"none\" stroke=\"{col}\" stroke-width=\"1.6\"{dash}><title>{label}</title></path>\n"));
    }
    // Axes and labels.
    s.push_str(&format!(
        "<line x1=\"{LEFT}\" y1=\"{0}\" x2=\"{1}\" y2=\"{0}\" stroke=\"#333\"/>\n<line x1=\"{LEFT}\" y1=\"{TOP}\" x2=\"{LEFT}\" y2=\"{0}\" stroke=\"#333\"/>\n",
        H - BOTTOM,
        W - RIGHT
    ));
    for i in 0..=4 {
        let b = (max_y / 1.05 * i as f64 / 4.0) as u64;
        s.push_str(&format!(
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{:.1} GiB</text>\n",
            LEFT - 6.0,
            y(b) + 4.0,
            in_gib(b)
        ));
    }
    s.push_str(&format!(
        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">trace events</text>\n",
        (LEFT + W - RIGHT) / 2.0,
        H - 10.0
    ));
    let mut ly = TOP + 10.0;
    for t in Tag::ALL {
        s.push_str(&format!(
            "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"12\" height=\"12\" fill=\"{}\"/><text x=\"{:.1}\" y=\"{:.1}\">live: {}</text>\n",
            W - RIGHT + 12.0,
            ly - 10.0,
            color(t),
            W - RIGHT + 30.0,
            ly,
            t.name()
        ));
        ly += 20.0;
    }
    for (label, col, dash) in [
        ("ours reserved", "#d62728", ""),
        ("PyTorch reserved", "#000000", " stroke-dasharray=\"6,4\""),
    ] {
        s.push_str(&format!(
            "<line x1=\"{:.1}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"{col}\" stroke-width=\"2\"{dash}/><text x=\"{:.1}\" y=\"{:.1}\">{label}</text>\n",
            W - RIGHT + 10.0,
            ly - 4.0,
            W - RIGHT + 26.0,
            ly - 4.0,
            W - RIGHT + 30.0,
            ly
        ));
        ly += 20.0;
    }
    s.push_str("</svg>\n");
    s
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
