set terminal pngcairo size 900,720 noenhanced font 'sans,10'
set output 'dnvme_tune_logs/sweep.png'
set title "dnvme tune: 1 x 512M in /work/main/build/test-scratch/tools/tune-usage-chmycy1a from pinned host memory; 7 of 32 points (descent search), 3 loops each\n(* best; ov overlap_events, ss single_submit, p intra_op_parallelism)"
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.85 border -1
set boxwidth 0.9
set xtics rotate by 90 right scale 0 font ',9'
set ylabel 'GiB/s (median)'
set yrange [0:*]
set grid ytics
set key top right
set bmargin 11
plot 'dnvme_tune_logs/sweep_plot.dat' using 2:xtic(1) title 'write' lc rgb '#1f77b4', 'dnvme_tune_logs/sweep_plot.dat' using 3 title 'read' lc rgb '#ff7f0e'
