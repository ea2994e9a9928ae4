//! `HostFlag`: the compute stream waits for a host store and signals the host after earlier work,
//! with the data copied before the signal visible when the host sees it.

mod common;

use std::time::Duration;

use krasis_gpu::HostFlag;

#[test]
fn stream_waits_for_the_host_and_signals_back_after_its_copies() {
    let Some(dev) = common::gpu("stream_waits_for_the_host_and_signals_back_after_its_copies") else { return };
    let go = HostFlag::new(dev).unwrap();
    let ready = HostFlag::new(dev).unwrap();
    let src: Vec<f32> = (0..4096).map(|i| i as f32 * 0.5).collect();
    let d = dev.upload(&src, "host flag test data").unwrap();
    let mut host = unsafe { dev.alloc_pinned::<f32>(src.len()).unwrap() };
    let host_ptr = host.as_mut_ptr().unwrap();
    for round in 1..=3u64 {
        go.stream_wait_geq(dev, round).unwrap();
        // SAFETY: pinned; read only after `ready` reaches `round`.
        unsafe {
            dev.copy_to_host_async(&d.slice().slice(..), std::slice::from_raw_parts_mut(host_ptr, src.len())).unwrap();
        }
        ready.stream_write(dev, round).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(ready.load(), round - 1, "the stream ran past its wait before the host stored {round}");
        go.store(round);
        ready.spin_until_geq(dev, round).unwrap();
        // SAFETY: the copy completed before the stream wrote `ready`.
        let got = unsafe { std::slice::from_raw_parts(host_ptr, src.len()) };
        assert_eq!(got, &src[..], "round {round}: data copied before the signal");
    }
    dev.synchronize().unwrap();
}

#[test]
fn a_wait_that_can_never_finish_is_an_error_not_a_hang() {
    let Some(dev) = common::gpu("a_wait_that_can_never_finish_is_an_error_not_a_hang") else { return };
    let flag = HostFlag::new(dev).unwrap();
    dev.synchronize().unwrap();
    let e = flag.spin_until_geq(dev, 1).unwrap_err();
    assert!(e.to_string().contains("idle"), "{e}");
}
