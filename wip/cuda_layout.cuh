/* Layout kernels, communicators and the GPU SP layer: being written. */
