//! `anchorage-server --config server.toml`: see [`anchorage_server::service`].

fn main() -> anyhow::Result<()> {
    anchorage_server::service::main()
}
