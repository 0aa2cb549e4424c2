//! `sweep`: removes what killed test runs left (namespaces, veths, pin
//! directories, cgroups, temporary directories and the processes in them),
//! found by the PID in their names ([`xdpcni_e2e::sweep`]); what live runs
//! made is kept. `scripts/test.sh` runs it before the tests.

fn main() {
    let s = xdpcni_e2e::sweep::sweep();
    if s.is_empty() {
        println!("sweep: nothing left by killed test runs");
    } else {
        println!("sweep: removed {s:?}");
    }
}
