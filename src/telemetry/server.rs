//! The syslog receiver: UDP datagrams and TCP streams on already-bound sockets, each
//! message parsed and queued for the recorder with the sender's address. Malformed
//! input is counted and dropped; nothing here stops the receive loops but the cancel.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::syslog::{self, Framer};
use super::{Received, Source, Telemetry, TelemetryError};

/// Bounds on what one sender may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// TCP connections open at once; more are closed on accept.
    pub max_connections: usize,
    /// A TCP connection that sends nothing for this long is closed.
    pub idle_timeout: Duration,
    /// Longest message (and TCP frame), in bytes.
    pub max_line: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 64,
            idle_timeout: Duration::from_secs(300),
            max_line: 8192,
        }
    }
}

/// Parses one message and queues it, or counts it as malformed.
fn take(t: &Telemetry, peer: IpAddr, raw: &[u8], limits: &Limits, source: &str) {
    match syslog::parse(raw, limits.max_line) {
        Ok(line) => t.submit(Received {
            peer: Some(crate::credential::canonical(peer)),
            node: None,
            source: Source::Syslog,
            line,
        }),
        Err(why) => {
            t.stats.malformed.inc();
            tracing::debug!(%peer, %why, source, "syslog message dropped");
        }
    }
}

/// Serves syslog on `udp` and `tcp` until `cancel` fires.
pub async fn serve(
    udp: UdpSocket,
    tcp: TcpListener,
    telemetry: Arc<Telemetry>,
    limits: Limits,
    cancel: CancellationToken,
) -> Result<(), TelemetryError> {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let mut conns = JoinSet::new();
    // A datagram longer than the limit is cut by recv_from: one byte more tells.
    let mut buf = vec![0u8; limits.max_line + 1];
    loop {
        tokio::select! {
            biased;
            // CANCEL-SAFETY: only waits.
            _ = cancel.cancelled() => break,
            // CANCEL-SAFETY: recv_from is cancel-safe (a datagram is taken whole or not at all).
            r = udp.recv_from(&mut buf) => match r {
                Ok((n, peer)) => {
                    telemetry.stats.udp_messages.inc();
                    take(&telemetry, peer.ip(), &buf[..n], &limits, "udp");
                }
                // ICMP errors, a signal: keep receiving (after a breath, so a socket
                // that keeps failing does not spin a core).
                Err(e) => {
                    tracing::debug!(error = %e, "syslog UDP receive");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            // CANCEL-SAFETY: accept is cancel-safe.
            r = tcp.accept() => match r {
                Ok((stream, peer)) => {
                    let Ok(permit) = slots.clone().try_acquire_owned() else {
                        telemetry.stats.tcp_refused.inc();
                        tracing::warn!(%peer, max = limits.max_connections, "syslog TCP connection refused: too many open");
                        continue;
                    };
                    let (t, c) = (telemetry.clone(), cancel.clone());
                    conns.spawn(async move {
                        connection(stream, peer.ip(), &t, limits, c).await;
                        drop(permit);
                    });
                }
                Err(e) => {
                    // Out of file descriptors and the like: wait a little, keep serving.
                    tracing::warn!(error = %e, "syslog TCP accept");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            // CANCEL-SAFETY: join_next is cancel-safe; reaps finished connections.
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    conns.shutdown().await;
    Ok(())
}

/// Reads frames from one TCP sender until it closes, idles, breaks framing or pxed
/// stops.
async fn connection(
    mut stream: TcpStream,
    peer: IpAddr,
    t: &Telemetry,
    limits: Limits,
    cancel: CancellationToken,
) {
    let mut framer = Framer::new(limits.max_line);
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = tokio::select! {
            biased;
            // CANCEL-SAFETY: only waits.
            _ = cancel.cancelled() => return,
            // CANCEL-SAFETY: read is cancel-safe (no bytes are taken unless it completes).
            r = tokio::time::timeout(limits.idle_timeout, stream.read(&mut buf)) => match r {
                Err(_) => {
                    t.stats.tcp_idle_closed.inc();
                    tracing::debug!(%peer, "syslog TCP connection idle: closed");
                    return;
                }
                Ok(Ok(0)) | Ok(Err(_)) => return,
                Ok(Ok(n)) => n,
            },
        };
        framer.push(&buf[..n]);
        loop {
            match framer.next_frame() {
                Ok(Some(frame)) => {
                    t.stats.tcp_messages.inc();
                    take(t, peer, &frame, &limits, "tcp");
                }
                Ok(None) => break,
                Err(why) => {
                    t.stats.malformed.inc();
                    tracing::debug!(%peer, %why, "syslog TCP stream broken: closed");
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    async fn start(limits: Limits) -> (Arc<Telemetry>, std::net::SocketAddr, CancellationToken) {
        // Syslog listens on one port number for both protocols; the UDP
        // port the kernel picks may be taken for TCP by another test, so
        // pick again until both are free.
        let (udp, tcp, addr) = loop {
            let udp = UdpSocket::bind("127.0.0.1:0").await.unwrap();
            let addr = udp.local_addr().unwrap();
            match TcpListener::bind(addr).await {
                Ok(tcp) => break (udp, tcp, addr),
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => continue,
                Err(e) => panic!("bind TCP {addr}: {e}"),
            }
        };
        let t = Arc::new(Telemetry::default());
        let c = CancellationToken::new();
        tokio::spawn(serve(udp, tcp, t.clone(), limits, c.clone()));
        (t, addr, c)
    }

    async fn next(rx: &mut tokio::sync::mpsc::Receiver<Received>) -> Received {
        tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .expect("a line in time")
            .expect("queue open")
    }

    #[tokio::test]
    async fn udp_and_tcp_lines_reach_the_queue_garbage_is_counted() {
        let (t, addr, cancel) = start(Limits::default()).await;
        let mut rx = t.take_receiver().unwrap();
        let s = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        s.send_to(b"\xff\xfegarbage", addr).await.unwrap();
        s.send_to(b"<13>Dec  1 03:00:00 anna[1]: DEBUG: retrieving x 1", addr)
            .await
            .unwrap();
        let r = next(&mut rx).await;
        assert_eq!(r.line, "anna[1]: DEBUG: retrieving x 1");
        assert_eq!(r.peer, Some("127.0.0.1".parse().unwrap()));
        assert_eq!(t.stats.malformed.get(), 1);

        let mut c = TcpStream::connect(addr).await.unwrap();
        let counted = "<13>Dec  1 03:00:00 b: two";
        let wire = format!("<13>Dec  1 03:00:00 a: one\n{} {counted}", counted.len());
        c.write_all(wire.as_bytes()).await.unwrap();
        assert_eq!(next(&mut rx).await.line, "a: one");
        assert_eq!(next(&mut rx).await.line, "b: two");
        cancel.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn tcp_connections_are_bounded_and_idle_ones_closed() {
        let limits = Limits {
            max_connections: 1,
            idle_timeout: Duration::from_secs(10),
            max_line: 64,
        };
        let (t, addr, cancel) = start(limits).await;
        let mut first = TcpStream::connect(addr).await.unwrap();
        let mut second = TcpStream::connect(addr).await.unwrap();
        let mut b = [0u8; 1];
        // The second is closed at once: the only slot is taken.
        assert_eq!(second.read(&mut b).await.unwrap(), 0);
        assert_eq!(t.stats.tcp_refused.get(), 1);
        // The first idles out.
        assert_eq!(first.read(&mut b).await.unwrap(), 0);
        assert_eq!(t.stats.tcp_idle_closed.get(), 1);
        // Then a newcomer gets the slot; an over-long line closes it.
        let mut third = TcpStream::connect(addr).await.unwrap();
        third.write_all(&[b'x'; 100]).await.unwrap();
        assert_eq!(third.read(&mut b).await.unwrap(), 0);
        assert_eq!(t.stats.malformed.get(), 1);
        cancel.cancel();
    }
}
