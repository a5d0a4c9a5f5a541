"""The rank processes both launchers start (a local launch and each Slurm task): their environment and output
(processes), NUMA binding (numa), the nsys prefix (nsys), warm starts (warm/), how a rank's end is read (exits)
and the process tree (proc_tree: whose child each process is).
No torch: the ranks import it themselves."""
