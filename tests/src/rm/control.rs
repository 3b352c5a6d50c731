//! `NV_ESC_RM_CONTROL` on a [`Ctl`]: the scheduling controls on channel groups and channels,
//! `FIFO_DISABLE_CHANNELS`, `FB_GET_INFO_V2`, and any control with parameters as given (the
//! malformed calls of the tests included).

use gpud_common::{
    nv,
    rm::{self, Handle},
};

use super::{Ctl, Plain, Reply, bytes_of_mut};

impl Ctl<'_> {
    /// `NVA06C_CTRL_CMD_SET_TIMESLICE` of `us` microseconds on channel group `tsg`.
    pub fn set_timeslice(&self, client: Handle, tsg: Handle, us: u64) -> Reply {
        let mut p = rm::tsg::TimesliceParams { timeslice_us: us };
        self.control(client, tsg, rm::tsg::SET_TIMESLICE, &mut p)
    }

    /// `NVA06C_CTRL_CMD_GET_TIMESLICE` on channel group `tsg`: the reply and the timeslice (µs)
    /// the parameters hold after the call (0 where the driver wrote nothing).
    pub fn get_timeslice(&self, client: Handle, tsg: Handle) -> (Reply, u64) {
        let mut p = rm::tsg::TimesliceParams::default();
        let r = self.control(client, tsg, rm::tsg::GET_TIMESLICE, &mut p);
        (r, p.timeslice_us)
    }

    /// `NV2080_CTRL_CMD_FIFO_DISABLE_CHANNELS` on `subdevice`: disables (or enables) the
    /// channels named by `pairs` of (client, channel) handles, whichever client they belong
    /// to. `numChannels` is `pairs.len()`; the lists hold the first
    /// [`DISABLE_CHANNELS_MAX`](rm::sched::DISABLE_CHANNELS_MAX).
    pub fn disable_channels(
        &self,
        client: Handle,
        subdevice: Handle,
        disable: bool,
        pairs: &[(Handle, Handle)],
    ) -> Reply {
        let mut p = rm::sched::DisableChannelsParams {
            disable: disable.into(),
            num_channels: pairs.len() as u32,
            ..Default::default()
        };
        for (i, &(c, h)) in pairs
            .iter()
            .take(rm::sched::DISABLE_CHANNELS_MAX)
            .enumerate()
        {
            p.client_list[i] = c;
            p.channel_list[i] = h;
        }
        self.control(client, subdevice, rm::sched::DISABLE_CHANNELS, &mut p)
    }

    /// Any RM control `cmd` on `object`, with the bytes of `params` as its parameters
    /// (`paramsSize` their length; an empty slice is a null pointer and size 0): the scheduling
    /// controls of [`rm::sched`] whatever their struct, or a size the driver refuses.
    pub fn sched_control(
        &self,
        client: Handle,
        object: Handle,
        cmd: u32,
        params: &mut [u8],
    ) -> Reply {
        let ptr = if params.is_empty() {
            std::ptr::null_mut()
        } else {
            params.as_mut_ptr()
        };
        // SAFETY: `ptr` is null with size 0, or `params`, live and exactly that long.
        unsafe { self.control_raw(client, object, cmd, ptr, params.len() as u32) }
    }

    /// `NV_ESC_RM_CONTROL` with `p` as it stands (any `flags`, `cmd`, pointer and size): the
    /// reply, with the status RM wrote back into `p` as well.
    ///
    /// # Safety
    /// `p.params` must be null or valid for reads and writes of `p.params_size` bytes.
    pub unsafe fn control_nvos54(&self, p: &mut rm::Nvos54) -> Reply {
        let call = self.escape(nv::NV_ESC_RM_CONTROL, p, false);
        Reply::of(call, p.status, p.h_object)
    }

    /// `NV_ESC_RM_CONTROL` `cmd` on `object` of `client`, with `params` as its parameters.
    pub fn control<P: Plain>(
        &self,
        client: Handle,
        object: Handle,
        cmd: u32,
        params: &mut P,
    ) -> Reply {
        let ptr = bytes_of_mut(params).as_mut_ptr();
        // SAFETY: `params` is a live `P`, exactly the size declared.
        unsafe { self.control_raw(client, object, cmd, ptr, size_of::<P>() as u32) }
    }

    /// `NV_ESC_RM_CONTROL` with `size` bytes at `params` declared as the parameters, whatever
    /// they hold (for the malformed calls of the tests).
    ///
    /// # Safety
    /// `params` must be valid for reads and writes of `size` bytes.
    pub unsafe fn control_raw(
        &self,
        client: Handle,
        object: Handle,
        cmd: u32,
        params: *mut u8,
        size: u32,
    ) -> Reply {
        let mut p = rm::Nvos54 {
            h_client: client,
            h_object: object,
            cmd,
            flags: 0,
            params: params as u64,
            params_size: size,
            status: 0,
        };
        // SAFETY: as the caller guarantees for `params`.
        unsafe { self.control_nvos54(&mut p) }
    }

    /// `FB_GET_INFO_V2` on `subdevice` for `indices`: the reply and the (index, value) pairs
    /// as they read after the call.
    pub fn fb_info_v2(
        &self,
        client: Handle,
        subdevice: Handle,
        indices: &[u32],
    ) -> (Reply, Vec<(u32, u32)>) {
        use rm::fb;
        let mut p = fb::GetInfoV2Params::default();
        let n = indices.len().min(fb::MAX_LIST_SIZE);
        p.list_size = n as u32;
        for (e, i) in p.list.iter_mut().zip(indices) {
            e.index = *i;
        }
        let r = self.control(client, subdevice, fb::GET_INFO_V2, &mut p);
        (r, p.list[..n].iter().map(|e| (e.index, e.data)).collect())
    }
}
