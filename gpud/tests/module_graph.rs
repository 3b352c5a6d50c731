//! The daemon's modules import one way. Read from the sources as Rust (every `use` tree and
//! every path in code, whatever its form: `super::`, `self::`, `crate::`, or a child module's
//! bare name), each directory module's children must not reach one another in a circle (a
//! child reaching into its parent's own items is fine: the parent declares what they share),
//! at every level of every crate of the workspace; and no module of `gpud/src/daemon` imports
//! from `daemon/mod.rs`,
//! which only declares and re-exports. A new import that closes a circle fails here.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

use syn::visit::Visit;

/// A module's path in the crate, `crate::a::b` as `["a", "b"]`.
type ModPath = Vec<String>;

/// Every module file of the crate whose sources are at `src` (its library or, without one, its
/// binary; not `src/bin`) with its module path.
fn module_files(src: &Path) -> Vec<(ModPath, PathBuf)> {
    let root = ["lib.rs", "main.rs"]
        .iter()
        .map(|f| src.join(f))
        .find(|p| p.exists())
        .expect("a crate root");
    let mut out = vec![(Vec::new(), root)];
    fn walk(dir: &Path, at: &ModPath, out: &mut Vec<(ModPath, PathBuf)>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .expect("read src")
            .filter_map(Result::ok)
            .collect();
        entries.sort_by_key(|e| e.path());
        for e in entries {
            let path = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if path.is_dir() {
                if at.is_empty() && name == "bin" {
                    continue;
                }
                let mut m = at.clone();
                m.push(name);
                walk(&path, &m, out);
            } else if let Some(stem) = name.strip_suffix(".rs") {
                if at.is_empty() && (stem == "lib" || stem == "main") {
                    continue;
                }
                let m = if stem == "mod" {
                    at.clone()
                } else {
                    let mut m = at.clone();
                    m.push(stem.to_owned());
                    m
                };
                out.push((m, path));
            }
        }
    }
    walk(src, &Vec::new(), &mut out);
    out
}

/// Every path a file names, each as written (segments), from its `use` trees and its code,
/// outside `#[cfg(test)]` items.
#[derive(Default)]
struct Paths {
    found: Vec<Vec<String>>,
}

fn is_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg")
            && a.parse_args::<syn::Meta>()
                .is_ok_and(|m| m.path().is_ident("test"))
    })
}

impl Paths {
    fn use_tree(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.use_tree(prefix, &p.tree);
                prefix.pop();
            }
            syn::UseTree::Name(n) => {
                let mut full = prefix.clone();
                full.push(n.ident.to_string());
                self.found.push(full);
            }
            syn::UseTree::Rename(r) => {
                let mut full = prefix.clone();
                full.push(r.ident.to_string());
                self.found.push(full);
            }
            syn::UseTree::Glob(_) => self.found.push(prefix.clone()),
            syn::UseTree::Group(g) => {
                for t in &g.items {
                    self.use_tree(prefix, t);
                }
            }
        }
    }
}

impl<'ast> Visit<'ast> for Paths {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        let attrs = match item {
            syn::Item::Mod(m) => &m.attrs,
            syn::Item::Fn(f) => &f.attrs,
            syn::Item::Impl(i) => &i.attrs,
            syn::Item::Use(u) => &u.attrs,
            _ => return syn::visit::visit_item(self, item),
        };
        if !is_test(attrs) {
            syn::visit::visit_item(self, item);
        }
    }
    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        self.use_tree(&mut Vec::new(), &u.tree);
    }
    fn visit_path(&mut self, p: &'ast syn::Path) {
        if p.segments.len() > 1 {
            self.found
                .push(p.segments.iter().map(|s| s.ident.to_string()).collect());
        }
        syn::visit::visit_path(self, p);
    }
}

/// The module `written` (as named in module `at`) resolves to: the longest known module prefix
/// of its absolute path. `None` for paths outside the crate.
fn resolve(written: &[String], at: &ModPath, known: &BTreeSet<ModPath>) -> Option<ModPath> {
    // A file `a/b.rs` is module `a::b`; its `super` is `a`. `a/mod.rs` is module `a` too.
    let mut base = at.clone();
    let mut rest = written;
    match written.first()?.as_str() {
        "crate" => {
            base.clear();
            rest = &written[1..];
        }
        "self" => rest = &written[1..],
        "super" => {
            while rest.first().is_some_and(|s| s == "super") {
                base.pop()?;
                rest = &rest[1..];
            }
        }
        // A child module named bare (2018 paths).
        first => {
            let mut child = at.clone();
            child.push(first.to_owned());
            if !known.contains(&child) {
                return None;
            }
        }
    }
    let mut full = base;
    full.extend(rest.iter().cloned());
    (0..=full.len())
        .rev()
        .map(|n| full[..n].to_vec())
        .find(|p| known.contains(p))
}

/// Module → the modules its code names (resolved, itself excluded), of the crate at `src`.
fn graph(src: &Path) -> BTreeMap<ModPath, BTreeSet<ModPath>> {
    let files = module_files(src);
    let known: BTreeSet<ModPath> = files.iter().map(|(m, _)| m.clone()).collect();
    let mut out = BTreeMap::new();
    for (m, path) in &files {
        let text = std::fs::read_to_string(path).expect("read module");
        let file = syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let mut paths = Paths::default();
        paths.visit_file(&file);
        let deps: BTreeSet<ModPath> = paths
            .found
            .iter()
            .filter_map(|p| resolve(p, m, &known))
            .filter(|d| d != m)
            .collect();
        out.insert(m.clone(), deps);
    }
    out
}

fn name(m: &ModPath) -> String {
    if m.is_empty() {
        "crate".to_owned()
    } else {
        m.join("::")
    }
}

/// The circles among the children of each directory module: child A reaches child B when any
/// module in A's subtree names one in B's.
fn circles(g: &BTreeMap<ModPath, BTreeSet<ModPath>>) -> Vec<String> {
    let parents: BTreeSet<ModPath> = g
        .keys()
        .filter(|m| !m.is_empty())
        .map(|m| m[..m.len() - 1].to_vec())
        .collect();
    let mut found = Vec::new();
    for parent in parents {
        let depth = parent.len();
        let child_of = |m: &ModPath| -> Option<ModPath> {
            (m.len() > depth && m[..depth] == parent[..]).then(|| m[..=depth].to_vec())
        };
        let mut edges: BTreeMap<ModPath, BTreeSet<ModPath>> = BTreeMap::new();
        for (m, deps) in g {
            let Some(from) = child_of(m) else { continue };
            for d in deps {
                if let Some(to) = child_of(d)
                    && to != from
                {
                    edges.entry(from.clone()).or_default().insert(to);
                }
            }
        }
        fn visit(
            m: &ModPath,
            edges: &BTreeMap<ModPath, BTreeSet<ModPath>>,
            path: &mut Vec<ModPath>,
            done: &mut BTreeSet<ModPath>,
            found: &mut Vec<String>,
        ) {
            if let Some(at) = path.iter().position(|p| p == m) {
                let mut names: Vec<String> = path[at..].iter().map(name).collect();
                names.push(name(m));
                found.push(names.join(" → "));
                return;
            }
            if !done.insert(m.clone()) {
                return;
            }
            path.push(m.clone());
            for d in edges.get(m).into_iter().flatten() {
                visit(d, edges, path, done, found);
            }
            path.pop();
        }
        let mut done = BTreeSet::new();
        for m in edges.keys() {
            visit(m, &edges, &mut Vec::new(), &mut done, &mut found);
        }
    }
    found
}

/// The workspace's crates, by their source directory.
fn crate_sources() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    [
        "gpud/src",
        "gpud-api/src",
        "gpud-common/src",
        "gpud-ebpf/src",
        "gpud-runtime/src",
        "gpud-k8s/src",
        "xtask/src",
        "tests/src",
    ]
    .iter()
    .map(|d| root.join(d))
    .collect()
}

#[test]
fn no_module_reaches_a_sibling_that_reaches_back() {
    let mut found = Vec::new();
    for src in crate_sources() {
        let g = graph(&src);
        found.extend(
            circles(&g)
                .into_iter()
                .map(|c| format!("{}: {c}", src.display().to_string().replace("/gpud/..", ""))),
        );
    }
    let g = graph(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    assert!(g.len() >= 60, "read the daemon's modules: {}", g.len());
    let law = vec![
        "enforcement".to_owned(),
        "compute".to_owned(),
        "law".to_owned(),
    ];
    assert!(g.contains_key(&law), "the compute law was read");
    assert!(found.is_empty(), "import circles:\n{}", found.join("\n"));
}

#[test]
fn daemon_modules_do_not_import_from_daemon_mod() {
    let g = graph(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    let daemon = vec!["daemon".to_owned()];
    for (m, deps) in &g {
        if m.len() == 2 && m[0] == "daemon" {
            assert!(
                !deps.contains(&daemon),
                "{} imports from daemon/mod.rs, which only declares and re-exports",
                name(m)
            );
        }
    }
}
