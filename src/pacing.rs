//! Pacing: DHCP offers to new netboot clients wait while transfer slots are full.
//!
//! When hundreds of machines netboot at once, answering every DISCOVER at once only
//! moves the pile-up to TFTP and HTTP, where firmware gives up after a few timeouts.
//! pxed instead counts what is being served ([`Slots`]: first-stage transfers, i.e.
//! TFTP transfers and HTTP GETs under `/ipxe/`, and streams, i.e. HTTP GETs under
//! `/images/`) and holds the OFFER to a client that is about to start one of those
//! while that kind is full: until a slot frees or `offer_delay_max_ms` passes,
//! whichever comes first. Held, never dropped: firmware retransmits its DISCOVER at
//! about 4, 8 and 16 s, and an offer sent within the first interval costs it nothing.
//!
//! The counts only drive pacing: no transfer is refused because of them.
//!
//! [`pace`] is the pure decision; the DHCP server (`dhcp::serve`) holds the offers.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use dhcproto::v4::MessageType;
use tokio::sync::Notify;

use crate::boot::{BootDecision, BootKind};
use crate::config::Pacing;
use crate::metrics::{Counter, Gauge, Render, sample};

/// What a slot is used for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// A TFTP transfer or an HTTP GET under `/ipxe/` (the firmware's iPXE binary).
    FirstStage,
    /// An HTTP GET under `/images/` (kernels, initrds, disk images).
    Stream,
}

/// What a DHCP client is about to fetch once it is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wants {
    /// PXE or UEFI HTTP firmware, not iPXE yet: next is a first-stage download.
    FirstStage,
    /// iPXE: next are its script, then kernel and initrd (streams).
    Streams,
    /// Never held: not a DISCOVER, or not a netboot client.
    Nothing,
}

/// Slots in use, as read at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct InUse {
    pub first_stage: u64,
    pub streams: u64,
}

/// Whether an offer goes out now or waits for a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pace {
    Send,
    Hold,
}

/// What a client is about to fetch, from its message type and the boot decision
/// made for it. Only DISCOVERs are ever held: a REQUEST (selecting or renewing) is
/// answered by a server that already offered, and holding its ACK would only make
/// the client start over. Clients that get no boot file (phones, BMCs, reserved
/// hosts that do not netboot) fetch nothing from pxed.
pub fn wants(msg_type: MessageType, boot: &BootDecision) -> Wants {
    match (msg_type, boot) {
        (MessageType::Discover, BootDecision::Boot(b)) => match b.kind {
            BootKind::Tftp | BootKind::Http => Wants::FirstStage,
            BootKind::IpxeScript => Wants::Streams,
        },
        _ => Wants::Nothing,
    }
}

/// The pacing decision. Pure: the caller reads the counts.
pub fn pace(wants: Wants, in_use: InUse, limits: &Pacing) -> Pace {
    if limits.offer_delay_max_ms == 0 {
        return Pace::Send;
    }
    let full = match wants {
        Wants::FirstStage => in_use.first_stage >= u64::from(limits.max_first_stage),
        Wants::Streams => in_use.streams >= u64::from(limits.max_streams),
        Wants::Nothing => false,
    };
    if full { Pace::Hold } else { Pace::Send }
}

/// The shared counts: incremented by TFTP and HTTP while a transfer runs, read by
/// DHCP. Also the pacing counters rendered at `/metrics`.
#[derive(Debug, Default)]
pub struct Slots {
    first_stage: AtomicU64,
    streams: AtomicU64,
    /// One per kind, so a freed stream never wakes (and uses up the wake-up of) an
    /// offer waiting for a first-stage slot.
    first_stage_freed: Notify,
    streams_freed: Notify,
    /// Offers held (each once, however long).
    pub held: Counter,
    /// Milliseconds offers spent held, summed.
    pub held_ms: Counter,
    /// Offers held right now.
    pub held_now: Gauge,
    /// DISCOVER retries that found their client's offer already held.
    pub held_duplicates: Counter,
    /// Offers sent at once because the most offers were held already.
    pub held_overflow: Counter,
    /// Held offers sent because `offer_delay_max_ms` passed with their slots still
    /// full: the pacing is overrun (more nodes booting than the slots and the hold
    /// cover), and the transfers it meant to queue run at once.
    pub held_expired: Counter,
}

impl Slots {
    /// Empty counts.
    pub fn new() -> Arc<Slots> {
        Arc::new(Slots::default())
    }

    fn gauge(&self, slot: Slot) -> &AtomicU64 {
        match slot {
            Slot::FirstStage => &self.first_stage,
            Slot::Stream => &self.streams,
        }
    }

    /// Counts one transfer of `slot` until the guard is dropped.
    pub fn acquire(self: &Arc<Self>, slot: Slot) -> SlotGuard {
        self.gauge(slot).fetch_add(1, Ordering::Relaxed);
        SlotGuard {
            slots: self.clone(),
            slot,
        }
    }

    /// The counts now.
    pub fn in_use(&self) -> InUse {
        InUse {
            first_stage: self.first_stage.load(Ordering::Relaxed),
            streams: self.streams.load(Ordering::Relaxed),
        }
    }

    /// Notified once per freed slot of the kind `wants` waits for (`notify_one`: one
    /// held offer goes per freed slot, in the order they started waiting, rather than
    /// every held offer at once). `None` for [`Wants::Nothing`].
    pub fn freed(&self, wants: Wants) -> Option<&Notify> {
        match wants {
            Wants::FirstStage => Some(&self.first_stage_freed),
            Wants::Streams => Some(&self.streams_freed),
            Wants::Nothing => None,
        }
    }
}

/// One counted transfer; the count goes down (and a held offer may go) on drop.
#[derive(Debug)]
pub struct SlotGuard {
    slots: Arc<Slots>,
    slot: Slot,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.slots.gauge(self.slot).fetch_sub(1, Ordering::Relaxed);
        match self.slot {
            Slot::FirstStage => self.slots.first_stage_freed.notify_one(),
            Slot::Stream => self.slots.streams_freed.notify_one(),
        }
    }
}

impl Render for Slots {
    fn render(&self, out: &mut String) {
        let n = self.in_use();
        sample(
            out,
            "pxed_first_stage_in_flight",
            "First-stage transfers in flight (TFTP, HTTP under /ipxe/)",
            "gauge",
            n.first_stage,
        );
        sample(
            out,
            "pxed_streams_in_flight",
            "HTTP GETs under /images/ in flight",
            "gauge",
            n.streams,
        );
        sample(
            out,
            "pxed_dhcp_offers_held_total",
            "DHCP offers held for a free transfer slot",
            "counter",
            self.held.get(),
        );
        sample(
            out,
            "pxed_dhcp_offers_held_ms_total",
            "Milliseconds DHCP offers spent held, summed",
            "counter",
            self.held_ms.get(),
        );
        sample(
            out,
            "pxed_dhcp_offers_held_now",
            "DHCP offers held right now",
            "gauge",
            self.held_now.get(),
        );
        sample(
            out,
            "pxed_dhcp_offers_held_duplicates_total",
            "DISCOVER retries whose offer was already held (no second offer held)",
            "counter",
            self.held_duplicates.get(),
        );
        sample(
            out,
            "pxed_dhcp_offers_held_overflow_total",
            "Offers sent at once because the most offers were held already",
            "counter",
            self.held_overflow.get(),
        );
        sample(
            out,
            "pxed_dhcp_offers_held_expired_total",
            "Held offers sent when offer_delay_max_ms passed with their transfer slots still full",
            "counter",
            self.held_expired.get(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::boot::{BootReply, VendorClass};
    use std::net::Ipv4Addr;
    use std::time::Duration;

    fn boot(kind: BootKind) -> BootDecision {
        BootDecision::Boot(BootReply {
            kind,
            file: "f".into(),
            next_server: Ipv4Addr::LOCALHOST,
            vendor_class: VendorClass::PxeClient,
        })
    }

    #[test]
    fn what_clients_want() {
        use MessageType::*;
        let rows = [
            (Discover, boot(BootKind::Tftp), Wants::FirstStage),
            (Discover, boot(BootKind::Http), Wants::FirstStage),
            (Discover, boot(BootKind::IpxeScript), Wants::Streams),
            (Discover, BootDecision::NotNetboot, Wants::Nothing),
            (
                Discover,
                BootDecision::UnknownArch(Some(99)),
                Wants::Nothing,
            ),
            (Discover, BootDecision::UnknownArch(None), Wants::Nothing),
            (Request, boot(BootKind::Tftp), Wants::Nothing),
            (Request, boot(BootKind::IpxeScript), Wants::Nothing),
            (Request, BootDecision::NotNetboot, Wants::Nothing),
            (Inform, boot(BootKind::Tftp), Wants::Nothing),
            (Decline, boot(BootKind::Tftp), Wants::Nothing),
            (Release, boot(BootKind::IpxeScript), Wants::Nothing),
        ];
        for (t, b, want) in rows {
            assert_eq!(wants(t, &b), want, "{t:?} {b:?}");
        }
    }

    #[test]
    fn offers_are_held_only_when_their_kind_is_full() {
        let limits = Pacing {
            max_first_stage: 2,
            max_streams: 3,
            offer_delay_max_ms: 3000,
            ..Pacing::default()
        };
        let off = Pacing {
            offer_delay_max_ms: 0,
            ..limits.clone()
        };
        let at = |first_stage, streams| InUse {
            first_stage,
            streams,
        };
        use Pace::*;
        use Wants::*;
        let rows = [
            // (wants, in use, &limits, expected)
            (FirstStage, at(0, 0), &limits, Send),
            (FirstStage, at(1, 99), &limits, Send),
            (FirstStage, at(2, 0), &limits, Hold),
            (FirstStage, at(7, 0), &limits, Hold),
            (Streams, at(99, 2), &limits, Send),
            (Streams, at(0, 3), &limits, Hold),
            (Streams, at(0, 4), &limits, Hold),
            (Nothing, at(99, 99), &limits, Send),
            (Nothing, at(0, 0), &limits, Send),
            // offer_delay_max_ms = 0: pacing off.
            (FirstStage, at(7, 7), &off, Send),
            (Streams, at(7, 7), &off, Send),
        ];
        for (w, n, l, want) in rows {
            assert_eq!(pace(w, n, l), want, "{w:?} {n:?} {l:?}");
        }
    }

    #[tokio::test]
    async fn a_freed_slot_wakes_one_waiter_of_its_kind() {
        let slots = Slots::new();
        let a = slots.acquire(Slot::FirstStage);
        let b = slots.acquire(Slot::Stream);
        assert_eq!(
            slots.in_use(),
            InUse {
                first_stage: 1,
                streams: 1
            }
        );
        let first = slots.freed(Wants::FirstStage).unwrap().notified();
        let streams = slots.freed(Wants::Streams).unwrap().notified();
        tokio::pin!(first, streams);
        first.as_mut().enable();
        streams.as_mut().enable();
        drop(a);
        assert_eq!(slots.in_use().first_stage, 0);
        // The first-stage waiter is woken; the stream waiter is not.
        tokio::time::timeout(Duration::from_secs(1), first)
            .await
            .expect("woken");
        assert!(
            tokio::time::timeout(Duration::from_millis(20), streams.as_mut())
                .await
                .is_err(),
            "a freed first-stage slot woke a stream waiter"
        );
        drop(b);
        tokio::time::timeout(Duration::from_secs(1), streams)
            .await
            .expect("woken");
        assert_eq!(slots.in_use(), InUse::default());
        let mut out = String::new();
        slots.held.inc();
        slots.render(&mut out);
        assert!(out.contains("pxed_first_stage_in_flight 0\n"), "{out}");
        assert!(out.contains("pxed_dhcp_offers_held_total 1\n"), "{out}");
    }
}
