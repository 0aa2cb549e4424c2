//! The kernel functions the datapath calls (the conntrack kfuncs of
//! `lib/ct.h`), bound at load. aya 0.14 cannot relocate a kfunc call (an
//! extern in `.ksyms`), so the C source calls each as a helper with a number
//! of its own (`XDPCNI_KFUNC_*` in xdpcni.h); before aya reads the object,
//! each such call instruction becomes a kfunc call (`src_reg`
//! BPF_PSEUDO_KFUNC_CALL) of the kernel's BTF id for the function. On a
//! kernel whose BTF lacks one, the calls become `r0 = 0` and the program's
//! `xdpcni_ct_kfuncs` stays 0, so the check answers "the kernel's" and never
//! reaches them: flows on a NAT'd port take the kernel path, as before the
//! check.

use aya::Btf;
use aya_obj::btf::BtfKind;
use object::{Object, ObjectSection, SectionFlags};

use crate::{abi::c_layout, Error, Result};

/// Each helper number the source calls, and the kernel function it stands for.
const KFUNCS: [(u32, &str); 3] = [
    (c_layout::XDPCNI_KFUNC_SKB_CT_LOOKUP, "bpf_skb_ct_lookup"),
    (c_layout::XDPCNI_KFUNC_XDP_CT_LOOKUP, "bpf_xdp_ct_lookup"),
    (c_layout::XDPCNI_KFUNC_CT_RELEASE, "bpf_ct_release"),
];

/// The global the loader sets when the kfuncs are bound.
pub(crate) const CT_KFUNCS_GLOBAL: &str = "xdpcni_ct_kfuncs";

const INSN: usize = 8;
const BPF_JMP_CALL: u8 = 0x85;
const BPF_MOV64_IMM: u8 = 0xb7;
const BPF_PSEUDO_KFUNC_CALL: u8 = 2;
const SHF_EXECINSTR: u64 = 0x4;

/// A BPF object with its kfunc calls bound, 8-byte aligned as aya's ELF
/// parser needs.
pub(crate) struct Bound {
    words: Vec<u64>,
    len: usize,
    /// Whether every kfunc was found (the calls are kfunc calls).
    pub(crate) available: bool,
    /// How many call instructions were rewritten.
    pub(crate) calls: usize,
}

impl AsRef<[u8]> for Bound {
    fn as_ref(&self) -> &[u8] {
        self.bytes()
    }
}

impl Bound {
    /// Whether the programs may call the kfuncs: the kernel has them and
    /// the object calls them (an object whose calls were left out, or that
    /// has none, keeps `xdpcni_ct_kfuncs` 0).
    pub(crate) fn ct_kfuncs(&self) -> bool {
        self.available && self.calls > 0
    }

    /// The object's bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: `words` holds at least `len` initialized bytes; u8 has no
        // alignment or validity requirement.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), self.len) }
    }
}

/// The kernel's BTF ids of the kfuncs, in [`KFUNCS`] order, if it has all.
fn kernel_ids(btf: Option<&Btf>) -> Option<Vec<u32>> {
    let btf = btf?;
    KFUNCS
        .iter()
        .map(|(_, name)| btf.id_by_type_name_kind(name, BtfKind::Func).ok())
        .collect()
}

/// The file ranges (offset, size) of `object`'s executable sections: its
/// instructions, and nothing else (its BTF and strings may hold any bytes).
fn code_ranges(object: &[u8]) -> Result<Vec<(usize, usize)>> {
    let elf = object::File::parse(object).map_err(|e| Error::Invalid {
        what: "BPF object",
        why: e.to_string(),
    })?;
    Ok(elf
        .sections()
        .filter(|s| match s.flags() {
            SectionFlags::Elf { sh_flags } => sh_flags & SHF_EXECINSTR != 0,
            _ => false,
        })
        .filter_map(|s| {
            let (off, size) = s.file_range()?;
            Some((usize::try_from(off).ok()?, usize::try_from(size).ok()?))
        })
        .collect())
}

/// `object` with every call of an `XDPCNI_KFUNC_*` number bound to the
/// kernel function (by its id in `btf`, the running kernel's), or made
/// `r0 = 0` when the kernel lacks one.
pub(crate) fn bind(object: &[u8], btf: Option<&Btf>) -> Result<Bound> {
    let mut words = vec![0u64; object.len().div_ceil(INSN)];
    let mut bound = Bound {
        words: Vec::new(),
        len: object.len(),
        available: false,
        calls: 0,
    };
    // SAFETY: `words` has room for object.len() bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(
            object.as_ptr(),
            words.as_mut_ptr().cast::<u8>(),
            object.len(),
        );
    }
    bound.words = words;
    let ids = kernel_ids(btf);
    bound.available = ids.is_some();
    let ranges = code_ranges(object)?;
    let bytes = bound.bytes_mut();
    let mut calls = 0;
    for (off, size) in ranges {
        let Some(text) = bytes.get_mut(off..off.saturating_add(size)) else {
            continue;
        };
        for insn in text.chunks_exact_mut(INSN) {
            // code, dst/src registers, off (2 bytes), imm (4 bytes, little endian).
            if insn[0] != BPF_JMP_CALL || insn[1] != 0 || insn[2] != 0 || insn[3] != 0 {
                continue;
            }
            let imm = u32::from_le_bytes([insn[4], insn[5], insn[6], insn[7]]);
            let Some(k) = KFUNCS.iter().position(|(n, _)| *n == imm) else {
                continue;
            };
            match &ids {
                Some(ids) => {
                    insn[1] = BPF_PSEUDO_KFUNC_CALL << 4;
                    insn[4..8].copy_from_slice(&ids[k].to_le_bytes());
                }
                None => {
                    insn[0] = BPF_MOV64_IMM;
                    insn[4..8].copy_from_slice(&0u32.to_le_bytes());
                }
            }
            calls += 1;
        }
    }
    bound.calls = calls;
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The instructions of `object`'s executable sections.
    fn code_of(object: &[u8]) -> Vec<[u8; INSN]> {
        code_ranges(object)
            .unwrap()
            .into_iter()
            .flat_map(|(off, size)| object[off..off + size].chunks_exact(INSN))
            .map(|i| <[u8; INSN]>::try_from(i).unwrap())
            .collect()
    }

    /// The datapath's calls: every kfunc called at least once, each bound
    /// on this kernel (CONFIG_NF_CONNTRACK=y puts them in vmlinux's BTF).
    #[test]
    fn the_datapaths_kfunc_calls_are_bound_to_this_kernels_ids() {
        let btf = Btf::from_sys_fs().unwrap();
        let b = bind(crate::DATAPATH_OBJECT, Some(&btf)).unwrap();
        assert!(b.available);
        // Two hooks each look up and release.
        assert!(b.calls >= 4, "{} calls", b.calls);
        assert_eq!(b.bytes().len(), crate::DATAPATH_OBJECT.len());
        let ids = kernel_ids(Some(&btf)).unwrap();
        let code = code_of(b.bytes());
        let found = |id: u32| {
            code.iter().any(|i| {
                i[0] == BPF_JMP_CALL
                    && i[1] == BPF_PSEUDO_KFUNC_CALL << 4
                    && u32::from_le_bytes([i[4], i[5], i[6], i[7]]) == id
            })
        };
        assert!(ids.iter().all(|id| found(*id)), "{ids:?}");
        // No helper call of a kfunc number is left.
        let left = code.iter().any(|i| {
            i[0] == BPF_JMP_CALL
                && i[1] == 0
                && KFUNCS
                    .iter()
                    .any(|(n, _)| u32::from_le_bytes([i[4], i[5], i[6], i[7]]) == *n)
        });
        assert!(!left);
    }

    #[test]
    fn without_kernel_btf_the_calls_become_r0_0() {
        let b = bind(crate::DATAPATH_OBJECT, None).unwrap();
        assert!(!b.available);
        assert!(b.calls >= 4);
        assert!(!code_of(b.bytes())
            .iter()
            .any(|i| i[0] == BPF_JMP_CALL && (i[1] >> 4) == BPF_PSEUDO_KFUNC_CALL));
    }
}
