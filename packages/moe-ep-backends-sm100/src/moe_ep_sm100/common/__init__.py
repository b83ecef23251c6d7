"""What the sm100 kernels share: the config rules (`config`), the weight-pack check
(`pack_check`), E8M0-scaled weight packs (`e8m0`), the staging input checks and routing
buffers (`staging`), and for the two CuTe DSL kernels their drop, base class and shared
constructor arguments (`cutedsl`)."""
