//! The link model under real QUIC: a UDP socket for quinn (`AsyncUdpSocket`) whose datagrams cross
//! a [`Link`] in each direction. Sent datagrams wait in the uplink's queue until their modelled
//! arrival time (or are dropped); received datagrams are held until the downlink's. quinn's
//! congestion control, loss recovery and pacing see exactly what the model does.
//!
//! At the profile's `rebind_ms` the device's address changes under quinn's feet, as behind a NAT
//! that rebinds: the socket's datagrams leave from a new port from then on, and the old port
//! receives nothing more ([`Nat`]). The server sees the connection arrive from a new address and
//! migrates it (RFC 9000, section 9); the device's QUIC stack is not told.

use std::fmt;
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};

use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::link::{DuplexProfile, Link, LinkStats};

type Datagram = (SocketAddr, Vec<u8>);

/// A UDP socket whose traffic crosses a modelled link. Create it inside a tokio runtime.
pub struct ShapedSocket {
    nat: Arc<Nat>,
    epoch: Instant,
    up: Arc<Mutex<Link>>,
    egress: mpsc::UnboundedSender<(Instant, Datagram)>,
    ready: Mutex<mpsc::UnboundedReceiver<Datagram>>,
}

impl fmt::Debug for ShapedSocket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShapedSocket").field("local", &self.nat.socket().local_addr().ok()).finish()
    }
}

/// Counters of both directions.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct DuplexStats {
    pub up: LinkStats,
    pub down: LinkStats,
    /// Times the device's address changed (`DuplexProfile::rebind_ms`).
    pub rebinds: u64,
    /// Datagrams the device sent after its first address change, and of those the long-header
    /// ones (QUIC's Initial and Handshake packets: a new handshake).
    pub datagrams_after_rebind: u64,
    pub handshake_datagrams_after_rebind: u64,
}

/// A handle on a shaped socket's counters that outlives the endpoint's use of it.
#[derive(Debug, Clone)]
pub struct LinkHandle {
    up: Arc<Mutex<Link>>,
    down: Arc<Mutex<Link>>,
    nat: Weak<Nat>,
    counts: Arc<NatCounts>,
}

impl LinkHandle {
    pub fn stats(&self) -> DuplexStats {
        let get = |l: &Arc<Mutex<Link>>| l.lock().map(|l| l.stats().clone()).unwrap_or_default();
        DuplexStats {
            up: get(&self.up),
            down: get(&self.down),
            rebinds: self.counts.rebinds.load(Ordering::Relaxed),
            datagrams_after_rebind: self.counts.sent_after.load(Ordering::Relaxed),
            handshake_datagrams_after_rebind: self.counts.handshakes_after.load(Ordering::Relaxed),
        }
    }

    /// The device's address changes now (see [`Nat`]); its new address.
    pub fn rebind(&self) -> io::Result<SocketAddr> {
        self.nat.upgrade().ok_or_else(|| io::Error::other("the shaped socket is gone"))?.rebind()
    }
}

/// The device's side of the path: the socket its datagrams leave from and arrive on, which an
/// address change replaces (the old one's receive task stops, so the old port hears nothing).
struct Nat {
    current: Mutex<(Arc<tokio::net::UdpSocket>, oneshot::Sender<()>)>,
    down: Arc<Mutex<Link>>,
    epoch: Instant,
    ready: mpsc::UnboundedSender<Datagram>,
    counts: Arc<NatCounts>,
}

#[derive(Debug, Default)]
struct NatCounts {
    rebinds: AtomicU64,
    sent_after: AtomicU64,
    handshakes_after: AtomicU64,
}

impl Nat {
    /// Starts receiving on `socket`.
    fn start(
        socket: tokio::net::UdpSocket,
        down: Arc<Mutex<Link>>,
        epoch: Instant,
    ) -> (Arc<Self>, mpsc::UnboundedReceiver<Datagram>) {
        let (ready, ready_rx) = mpsc::unbounded_channel();
        let socket = Arc::new(socket);
        let (stop, stop_rx) = oneshot::channel();
        tokio::spawn(receive(socket.clone(), down.clone(), epoch, ready.clone(), stop_rx));
        let counts = Arc::new(NatCounts::default());
        (Arc::new(Self { current: Mutex::new((socket, stop)), down, epoch, ready, counts }), ready_rx)
    }

    fn socket(&self) -> Arc<tokio::net::UdpSocket> {
        self.current.lock().unwrap_or_else(|p| p.into_inner()).0.clone()
    }

    /// Moves to a new port on the same address; the old socket's receive task stops.
    fn rebind(&self) -> io::Result<SocketAddr> {
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        let ip = current.0.local_addr()?.ip();
        let socket = std::net::UdpSocket::bind(SocketAddr::new(ip, 0))?;
        socket.set_nonblocking(true)?;
        let socket = Arc::new(tokio::net::UdpSocket::from_std(socket)?);
        let (stop, stop_rx) = oneshot::channel();
        tokio::spawn(receive(socket.clone(), self.down.clone(), self.epoch, self.ready.clone(), stop_rx));
        let addr = socket.local_addr()?;
        *current = (socket, stop);
        self.counts.rebinds.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(%addr, "the modelled device's address changed");
        Ok(addr)
    }

    /// Counts a datagram about to leave after an address change.
    fn count_sent(&self, datagram: &[u8]) {
        if self.counts.rebinds.load(Ordering::Relaxed) == 0 {
            return;
        }
        self.counts.sent_after.fetch_add(1, Ordering::Relaxed);
        if datagram.first().is_some_and(|b| b & 0x80 != 0) {
            self.counts.handshakes_after.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl ShapedSocket {
    /// Wraps a bound socket; `seed` drives loss and jitter.
    pub fn new(socket: std::net::UdpSocket, profile: DuplexProfile, seed: u64) -> io::Result<(Arc<Self>, LinkHandle)> {
        socket.set_nonblocking(true)?;
        let socket = tokio::net::UdpSocket::from_std(socket)?;
        let epoch = Instant::now();
        let up = Arc::new(Mutex::new(Link::new(profile.up, seed)));
        let down = Arc::new(Mutex::new(Link::new(profile.down, seed ^ 0x5EED_D0A1)));
        let (egress, egress_rx) = mpsc::unbounded_channel();
        let (nat, ready) = Nat::start(socket, down.clone(), epoch);
        tokio::spawn(send_when_due(nat.clone(), egress_rx));
        let handle = LinkHandle { up: up.clone(), down, nat: Arc::downgrade(&nat), counts: nat.counts.clone() };
        for at in profile.rebind_ms {
            let handle = handle.clone();
            tokio::spawn(async move {
                tokio::time::sleep_until(epoch + std::time::Duration::from_millis(at)).await;
                if let Err(e) = handle.rebind() {
                    tracing::debug!(error = %e, "the modelled address change did not happen");
                }
            });
        }
        Ok((Arc::new(Self { nat, epoch, up, egress, ready: Mutex::new(ready) }), handle))
    }
}

/// Sends queued datagrams at their arrival times (the queue is in arrival order), from the
/// device's address at that time.
async fn send_when_due(nat: Arc<Nat>, mut rx: mpsc::UnboundedReceiver<(Instant, Datagram)>) {
    while let Some((due, (to, bytes))) = rx.recv().await {
        tokio::time::sleep_until(due).await;
        nat.count_sent(&bytes);
        if let Err(e) = nat.socket().send_to(&bytes, to).await {
            tracing::debug!(error = %e, "shaped send failed");
        }
    }
    // The endpoint let go of the socket: the receive task stops with the last reference.
    let _ = nat.current.lock().map(|mut c| std::mem::replace(&mut c.1, oneshot::channel().0));
}

/// Receives from the real socket, passes each datagram through the downlink and releases it to
/// quinn at its arrival time.
async fn receive(
    socket: Arc<tokio::net::UdpSocket>,
    down: Arc<Mutex<Link>>,
    epoch: Instant,
    ready: mpsc::UnboundedSender<Datagram>,
    mut stop: oneshot::Receiver<()>,
) {
    let (delay_tx, mut delay_rx) = mpsc::unbounded_channel::<(Instant, Datagram)>();
    let release = tokio::spawn(async move {
        while let Some((due, datagram)) = delay_rx.recv().await {
            tokio::time::sleep_until(due).await;
            if ready.send(datagram).is_err() {
                return;
            }
        }
    });
    let mut buf = vec![0u8; 65536];
    loop {
        tokio::select! {
            received = socket.recv_from(&mut buf) => match received {
                Ok((n, from)) => {
                    let now = Instant::now();
                    let arrival = down.lock().map(|mut l| l.transmit(now - epoch, n as u64)).unwrap_or(Err(super::link::Drop::Outage));
                    if let Ok(at) = arrival {
                        let _ = delay_tx.send((epoch + at, (from, buf[..n].to_vec())));
                    }
                }
                Err(e) => tracing::debug!(error = %e, "shaped receive failed"),
            },
            _ = &mut stop => break,
        }
    }
    release.abort();
}

/// The shaped socket never blocks a sender: the bottleneck queue (and its drop-tail) is the model's.
#[derive(Debug)]
struct AlwaysWritable;

impl UdpPoller for AlwaysWritable {
    fn poll_writable(self: Pin<&mut Self>, _cx: &mut Context) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

impl AsyncUdpSocket for ShapedSocket {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        Box::pin(AlwaysWritable)
    }

    fn try_send(&self, transmit: &Transmit) -> io::Result<()> {
        let segment = transmit.segment_size.unwrap_or(transmit.contents.len()).max(1);
        let now = Instant::now();
        let mut up = self.up.lock().map_err(|_| io::Error::other("link state poisoned"))?;
        for chunk in transmit.contents.chunks(segment) {
            if let Ok(at) = up.transmit(now - self.epoch, chunk.len() as u64) {
                let _ = self.egress.send((self.epoch + at, (transmit.destination, chunk.to_vec())));
            }
        }
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        let mut ready = self.ready.lock().map_err(|_| io::Error::other("link state poisoned"))?;
        let mut filled = 0;
        while filled < bufs.len().min(meta.len()) {
            let next = if filled == 0 {
                match ready.poll_recv(cx) {
                    Poll::Ready(Some(d)) => d,
                    Poll::Ready(None) => return Poll::Ready(Err(io::Error::other("shaped socket closed"))),
                    Poll::Pending => return Poll::Pending,
                }
            } else {
                match ready.try_recv() {
                    Ok(d) => d,
                    Err(_) => break,
                }
            };
            let (from, bytes) = next;
            let n = bytes.len().min(bufs[filled].len());
            bufs[filled][..n].copy_from_slice(&bytes[..n]);
            meta[filled] = recv_meta(from, n);
            filled += 1;
        }
        Poll::Ready(Ok(filled))
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.nat.socket().local_addr()
    }

    fn may_fragment(&self) -> bool {
        false
    }
}

/// The metadata of one received datagram of `len` bytes from `addr`. quinn-udp's `RecvMeta` is
/// `#[non_exhaustive]`: no struct literal from outside its crate.
#[expect(clippy::field_reassign_with_default, reason = "RecvMeta is non_exhaustive")]
fn recv_meta(addr: std::net::SocketAddr, len: usize) -> RecvMeta {
    let mut m = RecvMeta::default();
    m.addr = addr;
    m.len = len;
    m.stride = len;
    m
}
