//! A pipeline's steps laid out as a graph for server-rendered SVG: each
//! step in the column of its longest chain of `needs` from a first step,
//! in the order the pipeline lists them within a column, and an edge from
//! each needed step to the step that needs it. Pure: names in, geometry
//! out; the templates draw it (`partials/graph.html`).

use std::collections::HashMap;

/// A box's size and the gaps between boxes, in SVG user units.
pub const NODE_W: i64 = 200;
pub const NODE_H: i64 = 100;
const GAP_X: i64 = 56;
/// The gap between columns when an edge carries a condition: room for
/// its label.
const GAP_X_LABELLED: i64 = 150;
const GAP_Y: i64 = 20;
const MARGIN: i64 = 8;

/// One step to lay out: its name, the steps it needs (all of `needs`,
/// any of `needs_any`), its condition and its kind's name (its outline).
pub struct Spec<'a> {
    pub name: &'a str,
    pub needs: &'a [String],
    pub needs_any: &'a [String],
    pub when: Option<&'a str>,
    pub kind: &'a str,
    /// A step for each item: drawn as a stack of boxes.
    pub stacked: bool,
    /// It has an undo call: a dashed edge comes back to it from each
    /// step that needs it (that step failing undoes this one).
    pub undo: bool,
}

impl<'a> Spec<'a> {
    /// A step that needs `needs`, with no join or condition.
    pub fn new(name: &'a str, needs: &'a [String]) -> Self {
        Spec {
            name,
            needs,
            needs_any: &[],
            when: None,
            kind: "",
            stacked: false,
            undo: false,
        }
    }

    /// A compiled step's shape.
    pub fn of(s: &'a crate::domain::pipeline::Shape) -> Self {
        Spec {
            name: &s.name,
            needs: &s.needs,
            needs_any: &s.needs_any,
            when: s.when.as_deref(),
            kind: &s.kind,
            stacked: s.each.is_some(),
            undo: false,
        }
    }

    /// Every step it waits for: (name, whether only as one of a join).
    fn inputs(&self) -> impl Iterator<Item = (&'a String, bool)> {
        let needs: &'a [String] = self.needs;
        let any: &'a [String] = self.needs_any;
        needs
            .iter()
            .map(|n| (n, false))
            .chain(any.iter().map(|n| (n, true)))
    }
}

/// The longest a condition is quoted on its edge (in characters).
const LABEL_MAX: usize = 22;

/// `when` as an edge's label: `if <expression>`, cut to fit.
fn label_of(when: &str) -> String {
    let mut label = format!("if {when}");
    if label.chars().count() > LABEL_MAX {
        label = label.chars().take(LABEL_MAX - 1).collect();
        label.push('…');
    }
    label
}

/// A laid-out step; `lines` and `class` are the caller's (what the box
/// says, and how it is styled), `state` the word a reader hears.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    pub name: String,
    pub x: i64,
    pub y: i64,
    pub class: &'static str,
    /// A short word for the box's state, shown in it (never colour
    /// alone); empty when the box has none.
    pub state: String,
    pub lines: Vec<String>,
    /// Where the box links to; empty for none.
    pub href: String,
    /// Its condition, when no edge into it carries it (a step that needs
    /// nothing); empty for none.
    pub condition: String,
    /// Its outline, by its kind: a box with corners of radius `rx`, or
    /// the polygon `points` when not empty.
    pub rx: i64,
    pub points: String,
    /// A step for each item: a box drawn behind it, as a stack.
    pub stacked: bool,
}

/// A step's outline by its kind's name: a box for a call (rounded for a
/// sleep), a hexagon for an approval, an arrow for a signal.
fn outline(kind: &str, x: i64, y: i64) -> (i64, String) {
    let (w, h, cut) = (NODE_W, NODE_H, 14);
    let points = |p: &[(i64, i64)]| {
        p.iter()
            .map(|(px, py)| format!("{},{}", x + px, y + py))
            .collect::<Vec<_>>()
            .join(" ")
    };
    match kind {
        "sleep" => (h / 3, String::new()),
        "approval" => (
            0,
            points(&[
                (cut, 0),
                (w - cut, 0),
                (w, h / 2),
                (w - cut, h),
                (cut, h),
                (0, h / 2),
            ]),
        ),
        "signal" => (
            0,
            points(&[(0, 0), (w - cut, 0), (w, h / 2), (w - cut, h), (0, h)]),
        ),
        _ => (6, String::new()),
    }
}

impl Node {
    /// Where the box behind a stacked one is drawn: up and to the right.
    pub fn stack_x(&self) -> i64 {
        self.x + 6
    }

    pub fn stack_y(&self) -> i64 {
        self.y - 6
    }

    /// Where the box's text starts, left and baseline of the name.
    pub fn text_x(&self) -> i64 {
        self.x + 10
    }

    pub fn name_y(&self) -> i64 {
        self.y + 20
    }

    /// The baseline of the box's condition, under its lines.
    pub fn condition_y(&self) -> i64 {
        self.y + NODE_H - 10
    }

    /// The baseline of line `i` of the box.
    pub fn line_y(&self, i: &usize) -> i64 {
        self.y + 40 + 16 * i64::try_from(*i).unwrap_or(0)
    }
}

/// An edge as an SVG path from the right of one box to the left of
/// another: `any` when it is one of a join's (`needs_any`), and a label
/// (the condition of the step it leads to, on its first edge in).
#[derive(Debug, Clone, PartialEq)]
pub struct Edge {
    pub from: String,
    pub to: String,
    pub d: String,
    pub any: bool,
    /// A dashed edge back to a step with an undo call from a step that
    /// needs it.
    pub undo: bool,
    /// Empty for none; drawn at (`label_x`, `label_y`).
    pub label: String,
    pub label_x: i64,
    pub label_y: i64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Graph {
    /// Unique on the page: names the SVG's title for screen readers.
    pub id: String,
    pub title: String,
    pub nodes: Vec<Node>,
    pub edges: Vec<Edge>,
    pub width: i64,
    pub height: i64,
    pub node_w: i64,
    pub node_h: i64,
}

/// Each step's column: the length of its longest chain of needs. Needs
/// naming no listed step, and cycles (a checked configuration has none),
/// count as nothing.
fn columns(specs: &[Spec<'_>]) -> Vec<usize> {
    let index: HashMap<&str, usize> = specs.iter().enumerate().map(|(i, s)| (s.name, i)).collect();
    let mut col: Vec<Option<usize>> = vec![None; specs.len()];
    // At most n rounds settle a DAG of n steps; a cycle stops there.
    for _ in 0..=specs.len() {
        let mut changed = false;
        for (i, s) in specs.iter().enumerate() {
            let deps: Vec<Option<usize>> = s
                .inputs()
                .filter_map(|(n, _)| index.get(n.as_str()))
                .filter(|&&j| j != i)
                .map(|&j| col[j])
                .collect();
            if deps.iter().any(Option::is_none) {
                continue;
            }
            let c = deps.iter().flatten().map(|c| c + 1).max().unwrap_or(0);
            if col[i] != Some(c) {
                col[i] = Some(c);
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    col.into_iter().map(|c| c.unwrap_or(0)).collect()
}

/// Lays `specs` out; `decorate` fills in each node's class, state, lines
/// and link from its step's index.
pub fn layout(
    id: &str,
    title: &str,
    specs: &[Spec<'_>],
    mut decorate: impl FnMut(usize, &mut Node),
) -> Graph {
    let cols = columns(specs);
    let gap_x = if specs.iter().any(|s| s.when.is_some()) {
        GAP_X_LABELLED
    } else {
        GAP_X
    };
    let mut rows_in: HashMap<usize, i64> = HashMap::new();
    let mut at: HashMap<&str, (i64, i64)> = HashMap::new();
    let mut nodes = Vec::with_capacity(specs.len());
    for (i, s) in specs.iter().enumerate() {
        let row = rows_in.entry(cols[i]).or_insert(0);
        let x = MARGIN + cols[i] as i64 * (NODE_W + gap_x);
        let y = MARGIN + *row * (NODE_H + GAP_Y);
        *row += 1;
        at.insert(s.name, (x, y));
        let mut node = Node {
            name: s.name.to_owned(),
            x,
            y,
            class: "",
            state: String::new(),
            lines: Vec::new(),
            href: String::new(),
            condition: String::new(),
            rx: 0,
            points: String::new(),
            stacked: s.stacked,
        };
        (node.rx, node.points) = outline(s.kind, x, y);
        decorate(i, &mut node);
        nodes.push(node);
    }
    let mut edges = Vec::new();
    for s in specs {
        let mut label = s.when.map(label_of);
        for (n, any) in s.inputs() {
            let (Some(&(x1, y1)), Some(&(x2, y2))) = (at.get(n.as_str()), at.get(s.name)) else {
                continue;
            };
            let (x1, y1) = (x1 + NODE_W, y1 + NODE_H / 2);
            let y2 = y2 + NODE_H / 2;
            // The arrowhead's tip rests on the box's edge.
            let x2 = x2 - 2;
            let mid = (x1 + x2) / 2;
            edges.push(Edge {
                from: n.clone(),
                to: s.name.to_owned(),
                d: format!("M{x1} {y1} C{mid} {y1} {mid} {y2} {x2} {y2}"),
                any,
                undo: false,
                // Above the edge's end, ending where it enters the box
                // (drawn with `text-anchor: end`).
                label: label.take().unwrap_or_default(),
                label_x: x2 - 6,
                label_y: y2 - 6,
            });
        }
        if let (Some(label), Some(node)) = (label, nodes.iter_mut().find(|n| n.name == s.name)) {
            node.condition = label;
        }
    }
    let back = undo_edges(specs, &at);
    let width = nodes.iter().map(|n| n.x + NODE_W).max().unwrap_or(0) + MARGIN;
    let below = if back.is_empty() { 0 } else { UNDO_DIP + 4 };
    let height = nodes.iter().map(|n| n.y + NODE_H).max().unwrap_or(0) + MARGIN + below;
    edges.extend(back);
    Graph {
        id: id.to_owned(),
        title: title.to_owned(),
        nodes,
        edges,
        width,
        height,
        node_w: NODE_W,
        node_h: NODE_H,
    }
}

/// How far below the boxes an undo edge dips.
const UNDO_DIP: i64 = GAP_Y / 2;

/// The dashed edges back to each step with an undo call, one from each
/// step that needs it: from under the later box to under the earlier.
fn undo_edges(specs: &[Spec<'_>], at: &HashMap<&str, (i64, i64)>) -> Vec<Edge> {
    let mut edges = Vec::new();
    for undone in specs.iter().filter(|s| s.undo) {
        for later in specs {
            let needs_it = later.inputs().any(|(n, _)| n == undone.name);
            let (Some(&(x1, y1)), Some(&(x2, y2)), true) =
                (at.get(later.name), at.get(undone.name), needs_it)
            else {
                continue;
            };
            let (x1, y1) = (x1 + 24, y1 + NODE_H);
            let (x2, y2) = (x2 + NODE_W - 24, y2 + NODE_H + 2);
            let low = y1.max(y2) + UNDO_DIP;
            edges.push(Edge {
                from: later.name.to_owned(),
                to: undone.name.to_owned(),
                d: format!("M{x1} {y1} C{x1} {low} {x2} {low} {x2} {y2}"),
                any: false,
                undo: true,
                label: String::new(),
                label_x: 0,
                label_y: 0,
            });
        }
    }
    edges
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_undo_comes_back_dashed_from_each_step_that_needs_it() {
        let (none, a) = (needs(&[]), needs(&["a"]));
        let specs = [
            Spec {
                undo: true,
                ..Spec::new("a", &none)
            },
            Spec::new("b", &a),
            Spec::new("c", &a),
        ];
        let g = layout("g", "t", &specs, |_, _| {});
        let back: Vec<(&str, &str)> = g
            .edges
            .iter()
            .filter(|e| e.undo)
            .map(|e| (e.from.as_str(), e.to.as_str()))
            .collect();
        assert_eq!(back, [("b", "a"), ("c", "a")]);
        let plain = layout(
            "g",
            "t",
            &[Spec::new("a", &none), Spec::new("b", &a)],
            |_, _| {},
        );
        assert!(g.height > plain.height, "room below for the dip");
    }

    fn needs(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn steps_sit_after_everything_they_need() {
        // a → b, a → c, (b, c) → d; e stands alone; c is listed before b.
        let (none, a, bc) = (needs(&[]), needs(&["a"]), needs(&["b", "c"]));
        let specs = [
            Spec::new("a", &none),
            Spec::new("c", &a),
            Spec::new("d", &bc),
            Spec::new("b", &a),
            Spec::new("e", &none),
        ];
        let g = layout("g", "t", &specs, |i, n| n.lines.push(format!("#{i}")));
        let pos: HashMap<&str, (i64, i64)> = g
            .nodes
            .iter()
            .map(|n| (n.name.as_str(), (n.x, n.y)))
            .collect();
        let col = |n: &str| (pos[n].0 - MARGIN) / (NODE_W + GAP_X);
        assert_eq!(
            ["a", "b", "c", "d", "e"].map(col),
            [0, 1, 1, 2, 0],
            "columns by longest chain"
        );
        assert!(pos["c"].1 < pos["b"].1, "listed order within a column");
        assert!(pos["a"].1 < pos["e"].1);
        assert_eq!(g.edges.len(), 4);
        assert!(g.edges.iter().all(|e| e.d.starts_with('M')));
        assert_eq!(g.nodes[2].lines, ["#2"]);
        assert_eq!(g.width, MARGIN + 3 * NODE_W + 2 * GAP_X + MARGIN);
        assert_eq!(g.height, MARGIN + 2 * NODE_H + GAP_Y + MARGIN);
    }

    #[test]
    fn a_condition_labels_its_first_edge_and_a_join_is_drawn_as_one() {
        // a → (b if x, c if y) → d (any of b, c); e alone, if z.
        let (none, a, bc) = (needs(&[]), needs(&["a"]), needs(&["b", "c"]));
        let specs = [
            Spec::new("a", &none),
            Spec {
                when: Some("steps.a.output.kind == 'long one'"),
                ..Spec::new("b", &a)
            },
            Spec {
                when: Some("y"),
                ..Spec::new("c", &a)
            },
            Spec {
                needs_any: &bc,
                ..Spec::new("d", &none)
            },
            Spec {
                when: Some("input.z"),
                ..Spec::new("e", &none)
            },
        ];
        let g = layout("g", "t", &specs, |_, _| {});
        let edge = |from: &str, to: &str| g.edges.iter().find(|e| e.from == from && e.to == to);
        let ab = edge("a", "b").unwrap();
        assert_eq!(ab.label, "if steps.a.output.kin…");
        assert!(!ab.any);
        assert_eq!(edge("a", "c").unwrap().label, "if y");
        let joined = [edge("b", "d").unwrap(), edge("c", "d").unwrap()];
        assert!(joined.iter().all(|e| e.any && e.label.is_empty()));
        // The join sits after both branches.
        let x = |n: &str| g.nodes.iter().find(|m| m.name == n).unwrap().x;
        assert!(x("d") > x("b") && x("b") > x("a"));
        // A condition with no edge in is written in its box.
        let e = g.nodes.iter().find(|n| n.name == "e").unwrap();
        assert_eq!(e.condition, "if input.z");
        assert!(
            g.nodes
                .iter()
                .filter(|n| n.name != "e")
                .all(|n| n.condition.is_empty())
        );
        // Room for the labels between columns.
        assert_eq!(x("b") - x("a"), NODE_W + GAP_X_LABELLED);
    }

    #[test]
    fn a_step_is_drawn_in_its_kinds_shape() {
        let none = needs(&[]);
        let kinds = ["request", "sleep", "approval", "signal"];
        let specs: Vec<Spec<'_>> = kinds
            .iter()
            .map(|k| Spec {
                kind: k,
                ..Spec::new(k, &none)
            })
            .collect();
        let g = layout("g", "t", &specs, |_, _| {});
        let by = |k: &str| g.nodes.iter().find(|n| n.name == k).unwrap();
        assert_eq!((by("request").rx, by("request").points.as_str()), (6, ""));
        assert!(by("sleep").rx > 6 && by("sleep").points.is_empty());
        // A hexagon and an arrow, each within its box.
        for (k, corners) in [("approval", 6), ("signal", 5)] {
            let n = by(k);
            let points: Vec<(i64, i64)> = n
                .points
                .split(' ')
                .map(|p| {
                    let (x, y) = p.split_once(',').unwrap();
                    (x.parse().unwrap(), y.parse().unwrap())
                })
                .collect();
            assert_eq!(points.len(), corners, "{k}");
            assert!(
                points
                    .iter()
                    .all(|(x, y)| (n.x..=n.x + NODE_W).contains(x)
                        && (n.y..=n.y + NODE_H).contains(y))
            );
        }
    }

    #[test]
    fn unknown_needs_and_cycles_do_not_hang_or_panic() {
        let (x, a, b) = (needs(&["nowhere"]), needs(&["b"]), needs(&["a"]));
        let specs = [Spec::new("x", &x), Spec::new("a", &a), Spec::new("b", &b)];
        let g = layout("g", "t", &specs, |_, _| {});
        assert_eq!(g.nodes.len(), 3);
        assert_eq!(g.edges.len(), 2, "only edges between listed steps");
    }
}
