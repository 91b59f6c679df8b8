//! The link model under real QUIC: a UDP socket for quinn (`AsyncUdpSocket`) whose datagrams cross
//! a [`Link`] in each direction. Sent datagrams wait in the uplink's queue until their modelled
//! arrival time (or are dropped); received datagrams are held until the downlink's. quinn's
//! congestion control, loss recovery and pacing see exactly what the model does.

use std::fmt;
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::link::{DuplexProfile, Link, LinkStats};

type Datagram = (SocketAddr, Vec<u8>);

/// A UDP socket whose traffic crosses a modelled link. Create it inside a tokio runtime.
pub struct ShapedSocket {
    socket: Arc<tokio::net::UdpSocket>,
    epoch: Instant,
    up: Arc<Mutex<Link>>,
    egress: mpsc::UnboundedSender<(Instant, Datagram)>,
    ready: Mutex<mpsc::UnboundedReceiver<Datagram>>,
    /// Dropping it stops the receive task.
    _stop: oneshot::Sender<()>,
}

impl fmt::Debug for ShapedSocket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShapedSocket").field("local", &self.socket.local_addr().ok()).finish()
    }
}

/// Counters of both directions.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct DuplexStats {
    pub up: LinkStats,
    pub down: LinkStats,
}

/// A handle on a shaped socket's counters that outlives the endpoint's use of it.
#[derive(Debug, Clone)]
pub struct LinkHandle {
    up: Arc<Mutex<Link>>,
    down: Arc<Mutex<Link>>,
}

impl LinkHandle {
    pub fn stats(&self) -> DuplexStats {
        let get = |l: &Arc<Mutex<Link>>| l.lock().map(|l| l.stats().clone()).unwrap_or_default();
        DuplexStats { up: get(&self.up), down: get(&self.down) }
    }
}

impl ShapedSocket {
    /// Wraps a bound socket; `seed` drives loss and jitter.
    pub fn new(socket: std::net::UdpSocket, profile: DuplexProfile, seed: u64) -> io::Result<(Arc<Self>, LinkHandle)> {
        socket.set_nonblocking(true)?;
        let socket = Arc::new(tokio::net::UdpSocket::from_std(socket)?);
        let epoch = Instant::now();
        let up = Arc::new(Mutex::new(Link::new(profile.up, seed)));
        let down = Arc::new(Mutex::new(Link::new(profile.down, seed ^ 0x5EED_D0A1)));
        let (egress, egress_rx) = mpsc::unbounded_channel();
        let (ready_tx, ready) = mpsc::unbounded_channel();
        let (stop, stop_rx) = oneshot::channel();
        tokio::spawn(send_when_due(socket.clone(), egress_rx));
        let handle = LinkHandle { up: up.clone(), down: down.clone() };
        tokio::spawn(receive(socket.clone(), down, epoch, ready_tx, stop_rx));
        Ok((Arc::new(Self { socket, epoch, up, egress, ready: Mutex::new(ready), _stop: stop }), handle))
    }
}

/// Sends queued datagrams at their arrival times (the queue is in arrival order).
async fn send_when_due(socket: Arc<tokio::net::UdpSocket>, mut rx: mpsc::UnboundedReceiver<(Instant, Datagram)>) {
    while let Some((due, (to, bytes))) = rx.recv().await {
        tokio::time::sleep_until(due).await;
        if let Err(e) = socket.send_to(&bytes, to).await {
            tracing::debug!(error = %e, "shaped send failed");
        }
    }
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
        self.socket.local_addr()
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
