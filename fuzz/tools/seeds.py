#!/usr/bin/env python3
"""Writes the DHCP and TFTP seed corpora from firmware captures (see ../README.md).

Usage: seeds.py OUT_DIR CAPTURE.pcap...   (OUT_DIR gets dhcp_decide/ and tftp_request/)

Every distinct client datagram to port 67 and 69 (and ERROR/ACK to a transfer port) is
kept as one file. DHCP sessions are then derived from the captured DISCOVERs and
REQUESTs: the same firmware packets, addressed to the fuzz target's server (10.0.0.1)
and from the MACs its lease table has reservations or leases for, joined by the target's
`--pxed--` separator.
"""
import hashlib
import os
import struct
import sys

SEP = b"--pxed--"


def udp_payloads(path):
    d = open(path, "rb").read()
    end = "<" if struct.unpack("<I", d[:4])[0] in (0xA1B2C3D4, 0xA1B23C4D) else ">"
    off = 24
    while off + 16 <= len(d):
        _, _, incl, _ = struct.unpack(end + "IIII", d[off:off + 16])
        off += 16
        pkt, off = d[off:off + incl], off + incl
        if len(pkt) < 42 or pkt[12:14] != b"\x08\x00" or pkt[23] != 17:
            continue
        ip = pkt[14:]
        u = ip[(ip[0] & 15) * 4:]
        sp, dp, ln = struct.unpack(">HHH", u[:6])
        yield sp, dp, u[8:ln]


def options(p):
    i, out = 240, []
    while i < len(p) and p[i] != 255:
        if p[i] == 0:
            i += 1
            continue
        out.append((p[i], p[i + 2:i + 2 + p[i + 1]]))
        i += 2 + p[i + 1]
    return out


def rebuild(p, mac=None, ciaddr=None, msg_type=None, set_opts=(), drop=()):
    """The packet with chaddr/ciaddr/option 53 replaced and options set or dropped."""
    head = bytearray(p[:240])
    if mac is not None:
        head[28:34] = mac
    if ciaddr is not None:
        head[12:16] = bytes(ciaddr)
    body = bytearray()
    set_opts = dict(set_opts)
    for code, data in options(p):
        if code in drop or code in set_opts:
            continue
        if code == 53 and msg_type is not None:
            data = bytes([msg_type])
        body += bytes([code, len(data)]) + data
    for code, data in set_opts.items():
        body += bytes([code, len(data)]) + data
    return bytes(head + body + b"\xff")


def save(d, name, data):
    os.makedirs(d, exist_ok=True)
    open(os.path.join(d, name), "wb").write(data)


def main():
    out, caps = sys.argv[1], sys.argv[2:]
    dhcp, tftp = os.path.join(out, "dhcp_decide"), os.path.join(out, "tftp_request")
    seen, firmware = set(), {}
    for cap in caps:
        tag = os.path.splitext(os.path.basename(cap))[0]
        for sp, dp, p in udp_payloads(cap):
            if dp == 67 and p[0] == 1:
                o = dict(options(p))
                kind = {1: "discover", 3: "request"}.get(o.get(53, b"\0")[0], "other")
                vc = o.get(60, b"").split(b":")[0].decode(errors="replace").lower() or "plain"
                arch = int.from_bytes(o.get(93, b"\xff\xff"), "big")
                ipxe = "-ipxe" if o.get(77) == b"iPXE" else ""
                key = (tag, kind, vc, arch, ipxe)
                if key in seen:
                    continue
                seen.add(key)
                firmware.setdefault(kind, []).append(p)
                save(dhcp, f"{tag}-{vc}-arch{arch}{ipxe}-{kind}.bin", p)
            elif dp == 69:
                h = hashlib.sha1(p).hexdigest()[:8]
                op = {1: "rrq", 2: "wrq", 4: "ack", 5: "error"}.get(p[1], "op")
                save(tftp, f"{tag}-{op}-{h}.bin", p)
    # What a client sends on a transfer's port: UEFI's ERROR after its tsize probe
    # (code 8, RFC 2347 "option negotiation refused"), an ACK of block 1.
    save(tftp, "client-error-8.bin", b"\0\x05\0\x08tsize probe done\0")
    save(tftp, "client-ack-1.bin", b"\0\x04\0\x01")
    server = bytes([10, 0, 0, 1])
    mac = lambda n: bytes([0x52, 0x54, 0, 0, 0, n])
    for i, disc in enumerate(firmware.get("discover", [])[:3]):
        req = firmware["request"][i % len(firmware["request"])]
        for n in (1, 2, 3):
            m = mac(n)
            sel = rebuild(req, mac=m, set_opts={54: server, 50: bytes([10, 0, 0, 2 + n % 3])})
            renew = rebuild(req, mac=m, ciaddr=[10, 0, 0, 2 + n % 3], drop={50, 54})
            decline = rebuild(req, mac=m, msg_type=4, set_opts={54: server, 50: bytes([10, 0, 0, 2 + n % 3])})
            release = rebuild(req, mac=m, msg_type=7, ciaddr=[10, 0, 0, 2 + n % 3], set_opts={54: server}, drop={50})
            inform = rebuild(req, mac=m, msg_type=8, ciaddr=[10, 0, 0, 2 + n % 3], drop={50, 54})
            session = SEP.join([rebuild(disc, mac=m), sel, renew, decline, rebuild(disc, mac=m), sel, release, inform])
            save(dhcp, f"session-{i}-mac{n}.bin", session)
        relayed = bytearray(rebuild(disc, mac=mac(6), set_opts={82: b"\x01\x04eth0\x02\x06" + mac(9)}))
        relayed[3] = 1  # hops
        relayed[24:28] = bytes([10, 0, 5, 1])  # giaddr
        save(dhcp, f"relayed-{i}-discover.bin", bytes(relayed))


if __name__ == "__main__":
    main()
