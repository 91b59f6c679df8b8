//! The `anchorage-server` program, built inside the tests package so that its integration tests
//! can run it as a process (Cargo gives a test the path of its own package's binaries only) and
//! `kill -9` it. The code is the server's own `main`, not a copy.

fn main() -> anyhow::Result<()> {
    anchorage_server::service::main()
}
