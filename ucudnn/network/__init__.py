"""A whole network: its convolution layers (`zoo`), WR and WD over all its kernels (`optimize`), the
measurements split across processes (`parallel`), batch sizes for a cluster of unequal devices
(`cluster`) and the pictures of a WD solution (`plot`). Above the kernel layer and the solvers."""
