//! Debug aid: `cargo run --release -p gpusim --example trace -- FILTER [law|old] [honors|h200|ignores]`
//! prints per-second shares of the first matching case (and, for `law`, what it measured).
use gpud::enforcement::compute::law::LawParams;
use gpusim::{SEC, bench, law::LawController};

fn main() {
    let mut a = std::env::args().skip(1);
    let filter = a.next().unwrap_or_default();
    let ctrl = a.next().unwrap_or_else(|| "law".into());
    let mode = a.next().unwrap_or_else(|| "honors".into());
    let cases = bench::cases(false);
    let case = cases
        .iter()
        .find(|c| {
            c.scenario.name.contains(&filter)
                && format!("{:?}", c.mode).to_lowercase().contains(&mode)
        })
        .expect("case");
    let mut law = LawController::new(LawParams::default());
    let mut other = bench::controller(&ctrl).expect("controller");
    let out = if ctrl == "law" {
        case.scenario.run(&mut law)
    } else {
        case.scenario.run(other.as_mut())
    };
    println!("{}", case.scenario.name);
    let secs = case.scenario.duration / SEC;
    for s in 0..secs {
        let row: Vec<String> = out
            .names
            .iter()
            .map(|n| format!("{n} {:5.1}", out.share(n, s * SEC, (s + 1) * SEC)))
            .collect();
        println!(
            "{s:3}s {}  device {:5.1}",
            row.join("  "),
            out.device_busy(0, s * SEC, (s + 1) * SEC)
        );
    }
    if ctrl == "law" {
        println!("firmware {:?}", law.law().firmware(0));
        for (u, s) in law.law().stats() {
            println!("{u}: {s:?}");
        }
    }
}
