//! The deploy agent's LLDP listener: which switch port each NIC is cabled to.
//!
//! One AF_PACKET socket per NIC, bound to the NIC and to ethertype 0x88cc and joined to
//! the LLDP multicast group (01:80:c2:00:00:0e, which NICs otherwise filter out). All
//! of them are polled together for one window ([`WINDOW`], not per NIC); whatever
//! LLDPDU arrives first on a NIC is parsed by [`crate::inventory::lldp`]. The listener
//! never fails the deploy: a NIC whose socket cannot be opened (no CAP_NET_RAW, gone
//! since sysfs was read) is logged and skipped, a frame that does not parse is logged
//! and the NIC keeps listening.
//!
//! Plain libc/socket2 rather than a capture crate (pcap, pnet): one socket option and
//! one `bind` are all that is needed, and the agent runs from a ramdisk without
//! libpcap.

use std::collections::BTreeMap;
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, Socket, Type};
use thiserror::Error;

use crate::inventory::lldp::{self, Neighbor};

/// How long the agent listens, for all NICs at once. Switches send every 30 s by
/// default, so this catches a neighbour only when one is sending fast (a link that just
/// came up gets fast-start frames every second); it is what LLDP adds to collection.
pub const WINDOW: Duration = Duration::from_secs(2);

/// The nearest-bridge group address LLDPDUs are sent to.
const LLDP_MULTICAST: [u8; 6] = [0x01, 0x80, 0xc2, 0x00, 0x00, 0x0e];

/// Why a NIC could not be listened on.
#[derive(Debug, Error)]
pub enum ListenError {
    #[error("{nic}: no such interface: {source}")]
    NoInterface { nic: String, source: nix::Error },
    #[error("{nic}: {what}: {source}")]
    Socket {
        nic: String,
        what: &'static str,
        source: io::Error,
    },
}

/// Listens on `nics` for at most `window` (all at once) and returns the neighbour each
/// NIC heard from, by NIC name. Returns as soon as every NIC has one.
pub fn listen(nics: &[String], window: Duration) -> BTreeMap<String, Neighbor> {
    let deadline = Instant::now() + window;
    let mut open: Vec<(String, Socket)> = nics
        .iter()
        .filter_map(|nic| match open_socket(nic) {
            Ok(s) => Some((nic.clone(), s)),
            Err(e) => {
                eprintln!("pxed-agent: lldp: {e}; not listening there");
                None
            }
        })
        .collect();
    let mut heard = BTreeMap::new();
    let mut buf = [0u8; 9216];
    while !open.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        let mut fds: Vec<libc::pollfd> = open
            .iter()
            .map(|(_, s)| libc::pollfd {
                fd: s.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        // Rounded up so a sub-millisecond remainder does not spin.
        let ms = libc::c_int::try_from(left.as_millis() + 1).unwrap_or(libc::c_int::MAX);
        // SAFETY: `fds` is a live array of `fds.len()` pollfds for the call's duration.
        // libc rather than nix::poll: nix is built without its `poll` feature.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if rc < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            eprintln!("pxed-agent: lldp: poll: {e}");
            break;
        }
        let ready: Vec<bool> = fds.iter().map(|f| f.revents != 0).collect();
        let mut done = Vec::new();
        for (i, (nic, sock)) in open.iter_mut().enumerate() {
            if !ready[i] {
                continue;
            }
            // Drain what is queued; the first LLDPDU that parses is the answer.
            loop {
                match sock.read(&mut buf) {
                    Ok(n) => match lldp::parse_frame(&buf[..n]) {
                        Ok(neighbor) => {
                            heard.insert(nic.clone(), neighbor);
                            done.push(i);
                            break;
                        }
                        Err(e) => eprintln!("pxed-agent: lldp: {nic}: frame dropped: {e}"),
                    },
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        eprintln!("pxed-agent: lldp: {nic}: receive: {e}; not listening there");
                        done.push(i);
                        break;
                    }
                }
            }
        }
        for i in done.into_iter().rev() {
            open.swap_remove(i);
        }
    }
    heard
}

/// An AF_PACKET socket that receives only LLDP frames arriving on `nic`.
fn open_socket(nic: &str) -> Result<Socket, ListenError> {
    let err = |what| {
        move |source| ListenError::Socket {
            nic: nic.to_string(),
            what,
            source,
        }
    };
    let ifindex =
        nix::net::if_::if_nametoindex(nic).map_err(|source| ListenError::NoInterface {
            nic: nic.to_string(),
            source,
        })?;
    let ifindex = i32::try_from(ifindex)
        .map_err(|_| err("interface index")(io::Error::from(io::ErrorKind::InvalidInput)))?;
    let proto = lldp::ETHERTYPE.to_be();
    let sock = Socket::new(
        Domain::PACKET,
        Type::RAW,
        Some(Protocol::from(i32::from(proto))),
    )
    .map_err(err("open AF_PACKET socket (needs CAP_NET_RAW)"))?;
    sock.set_nonblocking(true)
        .map_err(err("set non-blocking"))?;
    // SAFETY: sockaddr_ll is plain data; all-zero is a valid value before the fields
    // below are set.
    let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    addr.sll_family = libc::AF_PACKET as u16;
    addr.sll_protocol = proto;
    addr.sll_ifindex = ifindex;
    // SAFETY: the pointer and length describe `addr`, alive for the call; the fd is open.
    let rc = unsafe {
        libc::bind(
            sock.as_raw_fd(),
            (&raw const addr).cast(),
            size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(err("bind")(io::Error::last_os_error()));
    }
    let mut mreq = libc::packet_mreq {
        mr_ifindex: ifindex,
        mr_type: libc::PACKET_MR_MULTICAST as u16,
        mr_alen: 6,
        mr_address: [0; 8],
    };
    mreq.mr_address[..6].copy_from_slice(&LLDP_MULTICAST);
    // SAFETY: as for bind: `mreq` is a packet_mreq alive for the call.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_PACKET,
            libc::PACKET_ADD_MEMBERSHIP,
            (&raw const mreq).cast(),
            size_of::<libc::packet_mreq>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(err("join the LLDP multicast group")(
            io::Error::last_os_error(),
        ));
    }
    Ok(sock)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_nic_is_skipped_not_waited_on() {
        let t = Instant::now();
        let heard = listen(&["pxed-no-such-nic0".to_string()], Duration::from_secs(5));
        assert!(heard.is_empty());
        // No socket opened: nothing to wait for.
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    }

    #[test]
    fn the_window_bounds_the_wait() {
        // `lo` carries no LLDP; without CAP_NET_RAW the socket is skipped and the call
        // returns at once, with it the call returns when the window closes.
        let t = Instant::now();
        let heard = listen(&["lo".to_string()], Duration::from_millis(300));
        assert!(heard.is_empty());
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    }
}
