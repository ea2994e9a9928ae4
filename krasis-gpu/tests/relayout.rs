//! Experts converted on the device from CPU expert cache records (`cpu-rb16-v1`) to GPU records
//! (`gpu-tile64-v1`) must be byte for byte what the host packer writes, on ragged shapes (K and
//! rows not multiples of the 64-element chunks and panels, padded groups), INT4 and INT8, group
//! sizes 32 / 64 / 128, in runs of experts (a first expert alone, then the rest); asymmetric INT4
//! g32 records (`4a`) become the GPU's INT8 g32 records of `int4_asym::to_int8_g32`.
//!
//! Without a GPU the test prints "SKIPPED: no GPU" and passes; `KRASIS_REQUIRE_GPU=1` fails instead.

mod common;

use common::{gpu, rand_f32, rng, up};
use krasis_gpu::relayout::CpuRecordGeometry;
use krasis_gpu::GpuExperts;
use krasis_quant::cpu_layout::{pack, pack_w13, PackedLayout};
use krasis_quant::group::quantize;
use krasis_quant::{Bits, QuantizedMatrix};

fn round_up(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

/// One layer's experts as the CPU expert cache lays them out (`records`: each expert's packed w13
/// and w2 at the cache's alignments) converted on the device in two runs (the first expert, then
/// the rest) into GPU records of `bits` at groups `gs`, which must equal what the host packer
/// writes for `want` (each expert's gate, up and down at that width) byte for byte.
#[allow(clippy::too_many_arguments)]
fn check_conversion(
    d: &krasis_gpu::GpuDevice,
    what: &str,
    (h, i): (usize, usize),
    (l13, l2): (PackedLayout, PackedLayout),
    records: &[(Vec<u8>, Vec<u8>)],
    bits: Bits,
    gs: (usize, usize),
    want: &[[QuantizedMatrix; 3]],
) {
    let n = records.len();
    let cpu_w2 = round_up(l13.bytes(), 64);
    let cpu_stride = round_up(cpu_w2 + l2.bytes(), 4096);
    let mut host = vec![0u8; n * cpu_stride];
    for (e, (w13, w2)) in records.iter().enumerate() {
        host[e * cpu_stride..][..w13.len()].copy_from_slice(w13);
        host[e * cpu_stride + cpu_w2..][..w2.len()].copy_from_slice(w2);
    }
    let src = up(d, &host, "cpu records");
    let cpu = CpuRecordGeometry { w13: l13, w2: l2, w2_offset: cpu_w2, stride: cpu_stride };
    // GPU records (the GPU expert cache's geometry), and what the host packer writes there.
    let probe = GpuExperts::new_quantized(d, "probe", 1, h, i, bits, gs.0, gs.1).unwrap();
    let layout = probe.quant_layout().unwrap();
    let (p13, p2) = layout.record_parts();
    let gw2 = round_up(p13, 64);
    let gstride = round_up(gw2 + p2, 4096);
    let mut expect = vec![0u8; n * gstride];
    for (e, [g, u, dn]) in want.iter().enumerate() {
        let rec = layout.pack(e, g, u, dn).unwrap().to_record();
        expect[e * gstride..][..p13].copy_from_slice(&rec[..p13]);
        expect[e * gstride + gw2..][..p2].copy_from_slice(&rec[p13..]);
    }
    let mut ge = GpuExperts::new_records(d, "converted", n, h, i, bits, gs, (gstride, gw2)).unwrap();
    let base = {
        use krasis_gpu::cudarc::driver::DevicePtr;
        src.device_ptr(d.stream()).0
    };
    for run in [0..1, 1..n] {
        let at = base + (run.start * cpu_stride) as u64;
        // SAFETY: `src` holds the records and lives past the synchronisation below.
        unsafe { ge.convert_cpu_records_async(d, d.stream(), run, at, &cpu) }.unwrap();
    }
    d.stream().synchronize().unwrap();
    let got = ge.download_records(d).unwrap().unwrap();
    if let Some(bad) = got.iter().zip(&expect).position(|(a, b)| a != b) {
        panic!(
            "{what}: byte {bad} of {} differs (expert {}, offset {}): {} against {}",
            got.len(),
            bad / gstride,
            bad % gstride,
            got[bad],
            expect[bad]
        );
    }
    eprintln!("relayout {what}, {n} experts: {} bytes equal the host packer's", got.len());
}

#[test]
fn cpu_records_convert_to_the_gpu_layout_on_the_device() {
    let Some(d) = gpu("cpu_records_convert_to_the_gpu_layout_on_the_device") else { return };
    let mut r = rng(77);
    // (hidden, inter, bits, gs over hidden, gs over inter, experts)
    for (h, i, bits, gs13, gs2, n) in [
        (128, 96, Bits::Int4, 64, 32, 3),
        (96, 160, Bits::Int4, 32, 32, 4),
        (192, 64, Bits::Int8, 64, 64, 2),
        (256, 128, Bits::Int4, 128, 128, 3),
        (64, 32, Bits::Int8, 32, 32, 5),
    ] {
        let q =
            |r: &mut _, rows, k, gs| -> QuantizedMatrix { quantize(&rand_f32(r, rows * k, 1.0), rows, k, bits, gs) };
        let experts: Vec<[QuantizedMatrix; 3]> =
            (0..n).map(|_| [q(&mut r, i, h, gs13), q(&mut r, i, h, gs13), q(&mut r, h, i, gs2)]).collect();
        let layouts = (PackedLayout::new(2 * i, h, gs13, bits).unwrap(), PackedLayout::new(h, i, gs2, bits).unwrap());
        let records: Vec<(Vec<u8>, Vec<u8>)> =
            experts.iter().map(|[g, u, dn]| (pack_w13(g, u).unwrap().0, pack(dn))).collect();
        let what = format!("{h}x{i} {bits:?} g{gs13}/{gs2}");
        check_conversion(d, &what, (h, i), layouts, &records, bits, (gs13, gs2), &experts);
    }
    // Geometry that does not hold the experts is refused.
    let mut ge = GpuExperts::new_records(d, "small", 1, 64, 32, Bits::Int4, (32, 32), (8192, 4608)).unwrap();
    let l = PackedLayout::new(64, 64, 32, Bits::Int4).unwrap();
    let bad = CpuRecordGeometry { w13: l, w2: l, w2_offset: 4096, stride: 8192 };
    // SAFETY: refused before any launch.
    let e = unsafe { ge.convert_cpu_records_async(d, d.stream(), 0..1, 0, &bad) }.unwrap_err();
    assert!(e.to_string().contains("do not hold"), "{e}");
}

/// Asymmetric INT4 g32 CPU records (`--cpu-expert-bits 4a`) convert on the device to the INT8 g32
/// GPU records of their host requantisation (`int4_asym::to_int8_g32`) byte for byte: ragged
/// shapes, a zero group, tiny and large magnitudes (subnormal f16 scales), runs of experts.
#[test]
fn int4a_records_convert_to_int8_on_the_device() {
    let Some(d) = gpu("int4a_records_convert_to_int8_on_the_device") else { return };
    use krasis_quant::int4_asym::{self, AsymMatrix};
    let mut r = rng(78);
    // (hidden, inter, experts, amplitude)
    for (h, i, n, amp) in [(128, 96, 3, 1.0f32), (96, 160, 2, 1e-5), (64, 32, 4, 300.0), (320, 64, 2, 0.02)] {
        let q = |r: &mut _, rows: usize, k: usize, zero: bool| -> AsymMatrix {
            let mut w = rand_f32(r, rows * k, amp);
            if zero {
                w[..32].fill(0.0);
            }
            int4_asym::quantize(&w, rows, k).unwrap()
        };
        let experts: Vec<[AsymMatrix; 3]> =
            (0..n).map(|e| [q(&mut r, i, h, e == 0), q(&mut r, i, h, false), q(&mut r, h, i, e == 1)]).collect();
        let layouts = (PackedLayout::new_int4_asym(2 * i, h).unwrap(), PackedLayout::new_int4_asym(h, i).unwrap());
        let records: Vec<(Vec<u8>, Vec<u8>)> =
            experts.iter().map(|[g, u, dn]| (int4_asym::pack_w13(g, u).unwrap().0, int4_asym::pack(dn))).collect();
        let want: Vec<[QuantizedMatrix; 3]> =
            experts.iter().map(|[g, u, dn]| [g, u, dn].map(int4_asym::to_int8_g32)).collect();
        let what = format!("4a -> int8 g32 {h}x{i} amp {amp}");
        check_conversion(d, &what, (h, i), layouts, &records, Bits::Int8, (32, 32), &want);
    }
    // 4a records into INT4 experts are refused, naming the widths.
    let l = PackedLayout::new_int4_asym(64, 64).unwrap();
    let l2 = PackedLayout::new_int4_asym(64, 32).unwrap();
    let cpu = CpuRecordGeometry { w13: l, w2: l2, w2_offset: 8192, stride: 16384 };
    let mut ge = GpuExperts::new_records(d, "int4", 1, 64, 32, Bits::Int4, (32, 32), (16384, 8192)).unwrap();
    // SAFETY: refused before any launch.
    let e = unsafe { ge.convert_cpu_records_async(d, d.stream(), 0..1, 0, &cpu) }.unwrap_err();
    assert!(e.to_string().contains("do not hold"), "{e}");
}
