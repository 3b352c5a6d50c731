//! docs/dbus-api.md's limit table (under `SetLimits`) says what the schema says: the same limits
//! in the same order, with the D-Bus types, ranges (or priority names) and annotations of
//! `gpud_api::limits`. A limit added to the schema, or a range changed, fails here until the
//! documentation follows.

use std::collections::BTreeSet;

use gpud_api::limits::{LimitKind, Priority};

/// One row of the table, its cells as written.
struct Row {
    name: String,
    types: String,
    range: String,
    annotation: String,
}

/// The text between backticks, in order.
fn quoted(cell: &str) -> Vec<&str> {
    cell.split('`').skip(1).step_by(2).collect()
}

/// The rows of the table that follows `SetLimits`' heading.
fn table() -> Vec<Row> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/dbus-api.md");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let section = text
        .split("\n### ")
        .find(|s| s.starts_with("`SetLimits("))
        .unwrap_or_else(|| panic!("no SetLimits section in {}", path.display()));
    let mut lines = section
        .lines()
        .skip_while(|l| !l.starts_with("| name | types | range | value | annotation |"));
    assert!(
        lines.next().is_some(),
        "no `| name | types | range | value | annotation |` table under SetLimits"
    );
    lines
        .skip(1) // | --- | … |
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let cells: Vec<&str> = l.trim_matches('|').split(" | ").map(str::trim).collect();
            assert_eq!(cells.len(), 5, "row {l:?}");
            let one = |cell: &str| {
                let q = quoted(cell);
                assert_eq!(q.len(), 1, "one `name` in {cell:?} of {l:?}");
                q[0].to_owned()
            };
            Row {
                name: one(cells[0]),
                types: cells[1].to_owned(),
                range: cells[2].to_owned(),
                annotation: one(cells[4]),
            }
        })
        .collect()
}

/// `lo–hi` with `hi` in decimal or as `2^N`.
fn range(cell: &str) -> Option<(u64, u64)> {
    let (lo, hi) = cell.split_once('–')?;
    let hi = match hi.split_once('^') {
        Some(("2", exp)) => 1u64.checked_shl(exp.parse().ok()?)?,
        Some(_) => return None,
        None => hi.parse().ok()?,
    };
    Some((lo.parse().ok()?, hi))
}

#[test]
fn the_documented_limit_table_is_the_schema() {
    let rows = table();
    let names: Vec<&str> = rows.iter().map(|r| r.name.as_str()).collect();
    let schema: Vec<&str> = LimitKind::ALL.iter().map(|k| k.dbus_name()).collect();
    assert_eq!(names, schema, "limit names, in the schema's order");
    for (row, kind) in rows.iter().zip(LimitKind::ALL) {
        let ty = kind.value_type();
        let types: BTreeSet<&str> = quoted(&row.types).into_iter().collect();
        let want: BTreeSet<&str> = ty.dbus_signatures().into_iter().collect();
        assert_eq!(types, want, "D-Bus types of {kind}");
        match ty.range() {
            Some(r) => assert_eq!(
                range(&row.range),
                Some(r),
                "range of {kind}: {:?}",
                row.range
            ),
            None => assert_eq!(
                quoted(&row.range),
                Priority::ALL.map(Priority::as_str).to_vec(),
                "classes of {kind}"
            ),
        }
        assert_eq!(
            row.annotation,
            format!("gpud.dev/{}", kind.annotation()),
            "annotation of {kind}"
        );
    }
}
