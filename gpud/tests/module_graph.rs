//! The daemon's modules import one way: no module of `src/daemon` reaches, through `super::`, a
//! sibling that reaches back to it (directly or around a longer circle), and none imports from
//! its parent `mod.rs`, which only declares and re-exports. Read from the sources, so a new
//! import that closes a circle fails here.

use std::collections::{BTreeMap, BTreeSet};

fn modules() -> BTreeMap<String, String> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/daemon");
    std::fs::read_dir(&dir)
        .expect("src/daemon")
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e
                .file_name()
                .to_string_lossy()
                .strip_suffix(".rs")?
                .to_owned();
            let text = std::fs::read_to_string(e.path()).ok()?;
            // Test modules may reach anywhere.
            let code = text
                .split("#[cfg(test)]")
                .next()
                .unwrap_or_default()
                .to_owned();
            Some((name, code))
        })
        .collect()
}

/// The sibling modules `code` names after `super::` (in paths and in `use super::{…}` lists),
/// and `mod` for an item taken straight from the parent.
fn uses(code: &str, siblings: &BTreeSet<String>) -> BTreeSet<String> {
    let first_segment = |item: &str| -> String {
        item.trim()
            .split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .next()
            .unwrap_or_default()
            .to_owned()
    };
    let mut out = BTreeSet::new();
    let mut note = |name: String| {
        if name.is_empty() || name == "self" {
            return;
        }
        out.insert(if siblings.contains(&name) {
            name
        } else {
            "mod".to_owned()
        });
    };
    for (i, _) in code.match_indices("super::") {
        let rest = &code[i + "super::".len()..];
        let Some(list) = rest.strip_prefix('{') else {
            note(first_segment(rest));
            continue;
        };
        // The list's top-level items, up to its matching brace.
        let (mut depth, mut item) = (0, String::new());
        for c in list.chars() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => break,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    note(first_segment(&item));
                    item.clear();
                    continue;
                }
                _ => {}
            }
            item.push(c);
        }
        note(first_segment(&item));
    }
    out
}

#[test]
fn daemon_modules_import_without_a_circle() {
    let mods = modules();
    let siblings: BTreeSet<String> = mods.keys().filter(|m| *m != "mod").cloned().collect();
    let graph: BTreeMap<&str, BTreeSet<String>> = mods
        .iter()
        .filter(|(m, _)| *m != "mod")
        .map(|(m, code)| (m.as_str(), uses(code, &siblings)))
        .collect();
    for (m, deps) in &graph {
        assert!(
            !deps.contains("mod"),
            "daemon/{m}.rs imports from daemon/mod.rs, which only declares and re-exports"
        );
    }
    // Depth-first search for a cycle.
    fn visit<'a>(
        m: &'a str,
        graph: &'a BTreeMap<&str, BTreeSet<String>>,
        path: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
    ) {
        if let Some(at) = path.iter().position(|p| *p == m) {
            panic!("import circle: {}", path[at..].join(" → ") + " → " + m);
        }
        if !done.insert(m) {
            return;
        }
        path.push(m);
        for d in graph.get(m).into_iter().flatten() {
            visit(d, graph, path, done);
        }
        path.pop();
    }
    let mut done = BTreeSet::new();
    for m in graph.keys() {
        visit(m, &graph, &mut Vec::new(), &mut done);
    }
    assert!(
        graph.len() >= 8,
        "read the daemon's modules: {:?}",
        graph.keys()
    );
}
