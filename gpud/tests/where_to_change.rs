//! docs/design.md's "Where to change what" names files by path: each must exist, so a file
//! moved or renamed without its row fails here.

use std::path::Path;

#[test]
fn every_file_the_table_names_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let design = std::fs::read_to_string(root.join("docs/design.md")).expect("docs/design.md");
    let table: Vec<&str> = design
        .split("## Where to change what")
        .nth(1)
        .expect("the section")
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2)
        .collect();
    assert!(table.len() >= 5, "rows: {table:?}");
    let mut named = 0;
    let mut missing = Vec::new();
    for row in &table {
        // Backticked words with a slash are paths (files, or directories ending in `/`).
        for (i, quoted) in row.split('`').enumerate() {
            if i % 2 == 0 || !quoted.contains('/') || quoted.contains(' ') {
                continue;
            }
            named += 1;
            if !root.join(quoted).exists() {
                missing.push(quoted.to_owned());
            }
        }
    }
    assert!(named >= 20, "only {named} paths found in the table");
    assert!(
        missing.is_empty(),
        "named in the table but absent: {missing:?}"
    );
}
