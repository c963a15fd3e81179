{{/*
Cross-field checks values.schema.json cannot express. Each failure names the values
to change; nothing is rendered that would deploy but never schedule.
*/}}
{{- define "disagg.validate" -}}
{{- $v := .Values -}}
{{- if and $v.apiKey.existingSecret $v.apiKey.create -}}
{{- fail "apiKey: set existingSecret or create, not both" -}}
{{- end -}}
{{- if and $v.apiKey.create (not $v.apiKey.keys) -}}
{{- fail "apiKey.create needs at least one key in apiKey.keys" -}}
{{- end -}}
{{- $app := $v.app -}}
{{- $dep := default dict $app.deployment -}}
{{- $mode := default "disaggregated" $dep.mode -}}
{{- $names := dict -}}
{{- $cap := dict "prefill" 0.0 "decode" 0.0 "mixed" 0.0 -}}
{{- range $g := $v.workerGroups -}}
{{- if hasKey $names $g.name -}}{{- fail (printf "workerGroups: the name %q is used twice" $g.name) -}}{{- end -}}
{{- $_ := set $names $g.name true -}}
{{- if not (and (le (int $g.minReplicas) (int $g.replicas)) (le (int $g.replicas) (int $g.maxReplicas))) -}}
{{- fail (printf "workerGroups[%s]: need minReplicas <= replicas <= maxReplicas (got %d, %d, %d)" $g.name (int $g.minReplicas) (int $g.replicas) (int $g.maxReplicas)) -}}
{{- end -}}
{{- $shm := int (include "disagg.shmGi" (dict "root" $ "group" $g)) -}}
{{- if le (int $g.memoryGi) $shm -}}
{{- fail (printf "workerGroups[%s]: memoryGi %d must exceed the memory-backed /dev/shm of %dGi (objectStoreGi + app.transfer.host.capacity_mb + shmHeadroomGi), which counts against the pod's memory limit" $g.name (int $g.memoryGi) $shm) -}}
{{- end -}}
{{- $_ := set $cap $g.role (addf (get $cap $g.role) (mulf (int $g.maxReplicas) (int $g.gpus))) -}}
{{- end -}}
{{- if le (int $v.head.memoryGi) (add1 (int $v.head.objectStoreGi)) -}}
{{- fail (printf "head: memoryGi %d must exceed the /dev/shm of objectStoreGi + 1 = %dGi" (int $v.head.memoryGi) (add1 (int $v.head.objectStoreGi))) -}}
{{- end -}}
{{- $roles := list "decode" -}}
{{- if eq $mode "disaggregated" -}}{{- $roles = list "prefill" "decode" -}}{{- end -}}
{{- $total := 0.0 -}}
{{- range $role := $roles -}}
{{- $hasGroup := false -}}
{{- range $g := $v.workerGroups -}}
{{- if or (eq $g.role $role) (eq $g.role "mixed") -}}{{- $hasGroup = true -}}{{- end -}}
{{- end -}}
{{- if not $hasGroup -}}
{{- fail (printf "no worker group can run %s replicas: add a group with role %s or mixed" $role $role) -}}
{{- end -}}
{{- $rc := default dict (get $dep $role) -}}
{{- $n := 1 -}}
{{- if hasKey $rc "max_replicas" -}}{{- if not (kindIs "invalid" $rc.max_replicas) -}}{{- $n = int $rc.max_replicas -}}{{- end -}}
{{- else if hasKey $rc "num_replicas" -}}{{- $n = int $rc.num_replicas -}}{{- end -}}
{{- $gpus := float64 (default 0 $rc.num_gpus) -}}
{{- $tp := int (default 1 $rc.tensor_parallel_size) -}}
{{- if and (gt $gpus 0.0) (gt $tp 1) -}}{{- $gpus = addf $gpus (sub $tp 1) -}}{{- end -}}
{{- $need := mulf $n $gpus -}}
{{- $have := addf (get $cap $role) (get $cap "mixed") -}}
{{- if gt $need $have -}}
{{- fail (printf "app.deployment.%s asks for up to %v GPUs (%d replicas x %v) but the worker groups that run %s replicas hold at most %v (maxReplicas x gpus)" $role $need $n $gpus $role $have) -}}
{{- end -}}
{{- $total = addf $total $need -}}
{{- end -}}
{{- $all := addf (get $cap "prefill") (get $cap "decode") (get $cap "mixed") -}}
{{- if gt $total $all -}}
{{- fail (printf "the app asks for up to %v GPUs but the worker groups hold at most %v" $total $all) -}}
{{- end -}}
{{- end -}}
