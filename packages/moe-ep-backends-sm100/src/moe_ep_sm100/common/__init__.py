"""What the sm100 kernels share: the config rules (`config`), the weight-pack check
(`pack_check`), E8M0-scaled weight packs (`e8m0`), the weight layout and mxfp8 input
staging of the two kernels with mxfp8 activations (`mx_layout`), and for the CuTe DSL
kernels their drop, base class and shared constructor arguments (`cutedsl`). The stagers'
input checks and routing buffers are shared with sm90: `moe_ep.backends.support.staging`."""
