"""The rank processes both launchers start (a local launch and each Slurm task): their environment and output
(processes), NUMA binding (numa), the nsys prefix (nsys), warm starts (warm/) and how a rank's end is read (exits).
No torch: the ranks import it themselves."""
