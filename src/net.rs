//! Interfaces and socket binding. Servers receive sockets bound here (or by tests).

use std::net::{Ipv4Addr, SocketAddr};

use socket2::{Domain, Protocol, Socket, Type};

/// Errors from interface lookup and binding.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("interface {0} does not exist")]
    NoInterface(String),
    #[error("interface {0} has no IPv4 address")]
    NoAddress(String),
    #[error("cannot list interfaces: {0}")]
    List(nix::Error),
    #[error("{addr} is already in use (another DHCP/TFTP/HTTP server running?)")]
    InUse { addr: SocketAddr },
    #[error("cannot bind {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot bind to interface {iface}: {source}")]
    BindDevice {
        iface: String,
        source: std::io::Error,
    },
}

/// An interface's first IPv4 address and netmask.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interface {
    pub name: String,
    pub addr: Ipv4Addr,
    pub netmask: Ipv4Addr,
}

impl Interface {
    /// Whether `ip` is in this interface's subnet.
    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        let m = u32::from(self.netmask);
        u32::from(ip) & m == u32::from(self.addr) & m
    }
}

/// Looks up an interface's IPv4 address.
pub fn interface(name: &str) -> Result<Interface, NetError> {
    let mut found = false;
    for ifa in nix::ifaddrs::getifaddrs().map_err(NetError::List)? {
        if ifa.interface_name != name {
            continue;
        }
        found = true;
        let (Some(addr), Some(mask)) = (ifa.address, ifa.netmask) else {
            continue;
        };
        if let (Some(a), Some(m)) = (addr.as_sockaddr_in(), mask.as_sockaddr_in()) {
            return Ok(Interface {
                name: name.to_string(),
                addr: a.ip(),
                netmask: m.ip(),
            });
        }
    }
    if found {
        Err(NetError::NoAddress(name.into()))
    } else {
        Err(NetError::NoInterface(name.into()))
    }
}

fn bind_err(addr: SocketAddr, e: std::io::Error) -> NetError {
    if e.kind() == std::io::ErrorKind::AddrInUse {
        NetError::InUse { addr }
    } else {
        NetError::Bind { addr, source: e }
    }
}

/// Binds a UDP socket, optionally to one interface (SO_BINDTODEVICE), with
/// SO_BROADCAST so DHCP can reply to 255.255.255.255. `reuse` lets several
/// per-interface sockets share port 67.
pub fn bind_udp(
    addr: SocketAddr,
    iface: Option<&str>,
    reuse: bool,
) -> Result<tokio::net::UdpSocket, NetError> {
    let s = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))
        .map_err(|e| bind_err(addr, e))?;
    if reuse {
        s.set_reuse_address(true).map_err(|e| bind_err(addr, e))?;
    }
    s.set_broadcast(true).map_err(|e| bind_err(addr, e))?;
    if let Some(name) = iface {
        s.bind_device(Some(name.as_bytes()))
            .map_err(|source| NetError::BindDevice {
                iface: name.into(),
                source,
            })?;
    }
    // Bursts of DISCOVERs and TFTP ACK storms: a larger receive buffer drops less.
    let _ = s.set_recv_buffer_size(4 << 20);
    let _ = s.set_send_buffer_size(4 << 20);
    s.set_nonblocking(true).map_err(|e| bind_err(addr, e))?;
    s.bind(&addr.into()).map_err(|e| bind_err(addr, e))?;
    tokio::net::UdpSocket::from_std(s.into()).map_err(|e| bind_err(addr, e))
}

/// Installs rustls' ring provider as the process default (reqwest is built without
/// one). Safe to call more than once.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The one policy for receive errors on a server's datagram socket (DHCP, TFTP): a
/// datagram socket's errors are about one packet or a passing condition (an ICMP
/// report of an earlier send, ENOBUFS, an interrupted call), so the server logs the
/// error, waits briefly when it is not a known transient one (so a persistent error
/// cannot spin a core) and goes on. One listener's error never stops the others; the
/// daemon stops only on cancel. Returns whether the error was a known transient one.
pub async fn after_recv_error(server: &'static str, e: &std::io::Error) -> bool {
    let transient = matches!(
        e.kind(),
        std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::Interrupted
            | std::io::ErrorKind::WouldBlock
    ) || e.raw_os_error() == Some(libc::ENOBUFS);
    if transient {
        tracing::debug!(server, error = %e, "receive error (transient)");
    } else {
        tracing::warn!(server, error = %e, "receive error; going on");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    transient
}

/// How many connections the HTTP server holds at once, and how many of those are kept for the
/// API, health and metrics when the rest are taken (by a flood of idle connections,
/// say). Connections beyond both are closed at once and counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    pub max: usize,
    pub reserve: usize,
}

impl ConnLimits {
    /// Limits that fit the process's file-descriptor limit: at most half of it goes
    /// to HTTP connections (TFTP transfers, the store and BMC calls need the rest),
    /// and at most 4,096.
    pub fn for_fd_limit(nofile: u64) -> ConnLimits {
        let max = usize::try_from(nofile / 2)
            .unwrap_or(usize::MAX)
            .clamp(16, 4096);
        ConnLimits {
            max,
            reserve: (max / 16).max(4),
        }
    }
}

/// Raises the soft open-files limit to the hard one (systemd gives services 1,024
/// soft, far more hard) and returns the soft limit now in force.
pub fn raise_fd_limit() -> u64 {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => hard,
            Err(e) => {
                tracing::warn!(error = %e, soft, hard, "could not raise the open-files limit");
                soft
            }
        },
        Ok((soft, _)) => soft,
        Err(_) => 1024,
    }
}

/// The soft open-files limit.
pub fn fd_limit() -> u64 {
    nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map(|(soft, _)| soft)
        .unwrap_or(1024)
}

/// Binds a TCP listener.
pub fn bind_tcp(addr: SocketAddr) -> Result<tokio::net::TcpListener, NetError> {
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))
        .map_err(|e| bind_err(addr, e))?;
    s.set_reuse_address(true).map_err(|e| bind_err(addr, e))?;
    s.set_nonblocking(true).map_err(|e| bind_err(addr, e))?;
    s.bind(&addr.into()).map_err(|e| bind_err(addr, e))?;
    s.listen(1024).map_err(|e| bind_err(addr, e))?;
    tokio::net::TcpListener::from_std(s.into()).map_err(|e| bind_err(addr, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_has_an_address() {
        let lo = interface("lo").unwrap();
        assert_eq!(lo.addr, Ipv4Addr::LOCALHOST);
        assert!(lo.contains(Ipv4Addr::new(127, 1, 2, 3)));
        assert!(matches!(interface("nope0"), Err(NetError::NoInterface(_))));
    }

    #[tokio::test]
    async fn port_in_use_is_clear() {
        let a = bind_udp("127.0.0.1:0".parse().unwrap(), None, false).unwrap();
        let addr = a.local_addr().unwrap();
        let e = bind_udp(addr, None, false).unwrap_err();
        assert!(matches!(e, NetError::InUse { .. }), "{e}");
    }
}
