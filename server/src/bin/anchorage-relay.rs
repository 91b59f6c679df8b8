//! `anchorage-relay --config relay.toml`: the server program as a relay, with the
//! server's allocator set-up; its config must have a `[parent]` table. See
//! [`anchorage_server::relay`].

#[path = "../main.rs"]
#[allow(dead_code, reason = "the module's own `main` is anchorage-server's")]
mod server_program;

fn main() -> anyhow::Result<()> {
    server_program::run(anchorage_server::service::Program::Relay)
}
