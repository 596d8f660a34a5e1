//! A pod's process that gives its TCP socket ztunnel's mark, as any process with `CAP_NET_RAW`
//! can from Linux 5.17, for tests that run it apart from ztunnel's cgroup.
//!
//! `weir-marked-socket bind ADDR`: binds there; prints `bound` or `refused <errno>`.
//! `weir-marked-socket request ADDR MESSAGE`: connects, sends one line, prints the client's
//! address and the one line answered.
//! `weir-marked-socket listen FAMILY-ADDR SECONDS`: listens without binding (the kernel picks
//! the port from the netns's `ip_local_port_range`, and no bind hook runs: autobind), in
//! `FAMILY-ADDR`'s family; prints `refused <errno>`, or `listening <port>` and then
//! `accepted <peer>` for the first connection within `SECONDS`, or `none`.
use std::{
    io::{ErrorKind, Write},
    net::{SocketAddr, TcpStream},
    time::Duration,
};

use anyhow::{bail, Context, Result};
use socket2::{Domain, Socket, Type};
use weir_common::ZTUNNEL_MARK;
use weir_tests::traffic::{read_line, set_timeouts, write_line};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(command), Some(address)) = (args.first(), args.get(1)) else {
        bail!(
            "usage: weir-marked-socket bind ADDR | request ADDR MESSAGE | listen FAMILY-ADDR SECONDS"
        );
    };
    let address: SocketAddr = address.parse().context("ADDR")?;
    let socket = Socket::new(Domain::for_address(address), Type::STREAM, None)?;
    socket.set_mark(ZTUNNEL_MARK).context("SO_MARK")?;
    match command.as_str() {
        "bind" => match socket.bind(&address.into()) {
            Ok(()) => println!("bound"),
            Err(error) => println!("refused {}", error.raw_os_error().unwrap_or(0)),
        },
        "request" => {
            let message = args.get(2).map(String::as_str).unwrap_or("hello");
            socket.connect(&address.into())?;
            let stream = TcpStream::from(socket);
            set_timeouts(&stream)?;
            write_line(&stream, message)?;
            println!("{} {}", stream.local_addr()?, read_line(&stream)?);
        }
        "listen" => {
            let seconds: u64 = args.get(2).context("SECONDS")?.parse()?;
            if let Err(error) = socket.listen(16) {
                println!("refused {}", error.raw_os_error().unwrap_or(0));
                return Ok(());
            }
            let port = socket
                .local_addr()?
                .as_socket()
                .context("an IP socket")?
                .port();
            println!("listening {port}");
            std::io::stdout().flush()?;
            // SO_RCVTIMEO bounds accept() too.
            socket.set_read_timeout(Some(Duration::from_secs(seconds)))?;
            match socket.accept() {
                Ok((_, peer)) => println!("accepted {:?}", peer.as_socket()),
                Err(error)
                    if matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) =>
                {
                    println!("none")
                }
                Err(error) => return Err(error.into()),
            }
        }
        other => bail!("unknown command {other:?}"),
    }
    Ok(())
}
